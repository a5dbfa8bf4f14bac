"""A Tensor's autograd, seen globally: flags, gradients, detaching.

:class:`GradMixin` (a base of :class:`shardwise.tensors.tensor.Tensor`) shows the global
view of autograd, which runs on the local blocks or on the whole value (torch
records each local op), as torch's own properties do for a plain tensor.

Invariants:
- Autograd runs on ``_whole`` when a Tensor holds it (one node per op, torch's own
  arithmetic; the blocks cut from it are views that autograd flows through), else on
  the blocks; the wrapper's C-level ``requires_grad`` stays False.
- Gradients: ``.grad`` is in the tensor's own layout; the Partial(SUM) axes of a
  tensor hold equal gradients and come back Replicated, other Partial ops come back
  as per-device derivatives under Partial(SUM) (:meth:`~GradMixin._grad_layout`). A
  leaf holding a whole (``nn.Parameter`` over ``shardwise.tensor(...)``) accumulates
  into the whole's ``.grad``, shown in the leaf's layout.
- The same local gradients give the same ``.grad`` Tensor (kept in the ``_grad_view``
  slot, keyed by the gradients' identity): optimizers read ``.grad`` often.
- ``backward()`` lives on ``Tensor`` itself and calls ``torch.autograd.backward``, whose
  handler (:mod:`shardwise.ops.autograd`) lays out its seed gradient; nothing here
  imports :mod:`shardwise.tensors.tensor`: new Tensors are built through ``type(self)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Self

import torch

from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.placements import ReduceOp
from shardwise.tensors import cache
from shardwise.tensors.relayout import RelayoutMixin

__all__ = ["GradMixin"]


class GradMixin(RelayoutMixin):
    """Autograd's flags and gradients of a Tensor, in its own layout (module doc)."""

    # Autograd runs on the shards (torch records each local op); these properties show
    # the global view of it, as torch's do for a plain tensor.
    @property
    def requires_grad(self) -> bool:
        whole = self._whole
        if whole is not None:
            return whole.requires_grad
        return any(s.requires_grad for s in self._shards if s is not None)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.requires_grad_(value)

    @property
    def is_leaf(self) -> bool:
        whole = self._whole
        if whole is not None:
            return whole.is_leaf
        return all(s.is_leaf for s in self._shards if s is not None)

    @property
    def grad_fn(self) -> Any:
        """The autograd node of the whole value or the first local shard (None for leaves)."""
        whole = self._whole
        if whole is not None:
            return whole.grad_fn
        return next((s.grad_fn for s in self._shards if s is not None), None)

    def requires_grad_(self, requires_grad: bool = True) -> Self:
        """Make this tensor a leaf that records gradients (in place on the flag only)."""
        if not self.is_leaf:
            if not requires_grad:
                raise ShardingError(
                    "requires_grad_(False) on a non-leaf tensor: it is the result of an op "
                    "that records gradients. Use x.detach()."
                )
            return self
        whole = self._whole
        if whole is not None and not self._layout.is_partial:
            # the whole becomes the leaf (a detached alias: never flag the caller's
            # tensor); shards are re-cut from it so that they carry its autograd
            if whole.requires_grad != requires_grad:
                self._whole = whole.detach().requires_grad_(requires_grad)
                self._blocks = None
            return self
        for s in self.unique_shards()[1]:
            s.requires_grad_(requires_grad)
        if requires_grad:
            self._whole = None
        return self

    @property
    def data(self) -> Self:
        """The same value cut from autograd (shares memory), as torch's ``.data``."""
        return self.detach()

    @data.setter
    def data(self, value: Any) -> None:
        """Swap this tensor's contents for ``value``'s (``module.to(dtype)`` does this)."""
        if not isinstance(value, type(self)):
            raise ShardingTypeError(
                f"x.data = value needs a shardwise.Tensor value, got {type(value).__name__}. "
                "Wrap it first with shardwise.tensor(value, sharding=x.sharding)."
            )
        grad = self.requires_grad
        new = value.detach()
        if grad:
            new = new.requires_grad_(True) if new._whole is not None and not (
                new._layout.is_partial) else new._map_unique(lambda s: s.requires_grad_(True))
        self._blocks, self._whole = new._blocks, new._whole
        self._layout, self._dtype = new._layout, new._dtype
        self._shape, self._size, self._open = new._shape, new._size, new._open
        self._device = new._device
        # keep the C-level metadata (dtype, shape) that torch's C++ code reads in sync
        with torch._C.DisableTorchFunctionSubclass():
            torch._C.TensorBase.data.__set__(self, value)  # type: ignore[attr-defined]

    def detach(self) -> Self:
        """The same value, cut from the autograd graph (shares memory)."""
        whole = self._whole
        if whole is not None:
            return type(self).from_whole(whole.detach(), self._layout, self._open)
        return self._map_unique(lambda s: s.detach())

    def _grad_layout(self) -> Layout:
        partial = tuple(
            None if op is None or op is ReduceOp.SUM else ReduceOp.SUM
            for op in self._layout.partial
        )
        return self._layout.with_partial(partial)

    def _wrap_grads(self, grads: dict[int, torch.Tensor | None]) -> Self:
        """Gradients keyed by id() of this tensor's shard objects -> a Tensor."""
        layout = self._grad_layout()
        reps = layout.representatives()
        zeros: dict[int, torch.Tensor] = {}
        owner: dict[int, int] = {}  # buffer id -> the one rep device its gradient lands on
        out: list[torch.Tensor | None] = []
        for k in range(len(self._shards)):
            if self._shards[k] is None:
                out.append(None)
                continue
            s = self._shards[reps[k]]
            if s is None:  # the representative lives in another process
                s = self._shards[k]
            # A buffer shared along a Partial axis (MIN/MAX/AVG hold the value on every
            # device) got one summed gradient: it lands once, the other devices get zeros,
            # so the Partial(SUM) gradient is not counted twice.
            first = owner.setdefault(id(s), reps[k])
            g = grads.get(id(s)) if first == reps[k] else None
            if g is None:
                g = zeros.get(id(s))
                if g is None:
                    g = zeros[id(s)] = torch.zeros_like(s)
            out.append(g)
        return type(self)(out, layout, self._shape, self._dtype)

    @property
    def grad(self) -> Self | None:
        """Accumulated gradient, in this tensor's layout; None before any backward."""
        whole = self._whole
        if whole is not None and not self._layout.is_partial:
            g = whole.grad
            if g is None:
                return None
            seen = self._grad_view
            if seen is not None and len(seen[0]) == 1 and seen[0][0] is g:
                return seen[1]
            out = type(self).from_whole(g, self._layout)
            self._grad_view = ((g,), out)
            return out
        shards = self._shards
        grads = tuple(shards[k].grad for k in self._unique())
        if all(g is None for g in grads):
            return None
        # the same shard gradients give the same Tensor (optimizers read .grad often)
        seen = self._grad_view
        if seen is not None and len(seen[0]) == len(grads) and all(
                a is b for a, b in zip(seen[0], grads)):
            return seen[1]
        out = self._wrap_grads({id(s): s.grad for s in shards if s is not None})
        self._grad_view = (grads, out)
        return out

    @grad.setter
    def grad(self, value: Self | None) -> None:
        """``p.grad = None`` (what ``zero_grad()`` does) or a Tensor of ``p``'s shape."""
        whole = self._whole
        if value is None:
            if whole is not None:
                whole.grad = None
                return
            for s in self._shards:
                if s is not None:
                    s.grad = None
            return
        if not isinstance(value, type(self)) or value.shape != self.shape:
            raise ShardingTypeError(
                f"p.grad must be None or a shardwise.Tensor of shape {self._shape}; got "
                f"{value!r:.120}. Build it with shardwise.tensor(g, sharding=p.sharding)."
            )
        if self._layout.is_partial:
            raise ShardingError(
                f"Setting .grad of {self!r}, whose layout is Partial: the gradient of a "
                "Partial value has no single per-device form. Reduce the tensor first."
            )
        g = value.detach().relayout(self._layout) if value.mesh == self.mesh else None
        if g is None:
            raise ShardingError(
                f"p.grad lives on {value.mesh!r} but p on {self.mesh!r}: move it with "
                "shardwise.to_device(g, sharding=p.sharding) first."
            )
        if whole is not None:
            whole.grad = (g._whole if g._whole is not None else g._global()).detach()
            return
        shards = self._shards
        for k in self._unique():
            shards[k].grad = g._shards[k]

    # --- autograd hooks: on the whole or on every distinct block, as autograd runs ----
    def register_hook(self, hook: Callable[[Any], Any]) -> Any:
        """Call ``hook(grad)`` each time autograd computes this tensor's gradient, with
        the gradient as ``.grad`` shows it (a Tensor in this tensor's layout); a Tensor
        the hook returns replaces the gradient. As torch's ``Tensor.register_hook``:
        the returned handle's ``remove()`` unregisters it.

        >>> mesh = DeviceMesh.cpu(2, "tp")
        >>> x = shardwise.tensor(torch.arange(4.0), sharding=PlacementMapping(
        ...     mesh, [Sharded(0)])).requires_grad_()
        >>> seen = []
        >>> h = x.register_hook(lambda g: seen.append(g.to_torch()))
        >>> (x * x).sum().backward()
        >>> seen[0].tolist(), x.grad.to_torch().tolist()
        ([0.0, 2.0, 4.0, 6.0], [0.0, 2.0, 4.0, 6.0])
        >>> h.remove()
        """
        if not self.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require "
                               "gradient")
        self._hookable("register_hook")
        whole = self._whole
        if whole is not None:
            def on_whole(g: torch.Tensor) -> torch.Tensor | None:
                out = hook(type(self).from_whole(g, self._layout))
                return None if out is None else self._whole_of(out)
            return whole.register_hook(on_whole)
        blocks = self.unique_shards()[1]

        def on_last(s: torch.Tensor, grads: dict[int, Any]) -> torch.Tensor | None:
            out = hook(self._wrap_grads(grads))
            if out is None:
                return None
            if len(blocks) > 1:
                raise ShardingError(
                    f"A hook on {self!r} returned a new gradient, but autograd runs on its "
                    f"{len(blocks)} local blocks one by one (a result on the simulated "
                    "mesh) and the others have passed already: a hook may only observe "
                    "such a gradient. Change it where it arrives (a leaf's hook, or .grad "
                    "after the backward); a leaf from shardwise.tensor(...) runs autograd "
                    "on one whole value, and under torchrun on each process's one block, "
                    "where a hook may replace it.")
            return self._block_of(out, s)
        return _on_every_block(blocks, "register_hook", on_last)

    def register_post_accumulate_grad_hook(self, hook: Callable[[Any], Any]) -> Any:
        """Call ``hook(self)`` after autograd accumulated into this leaf's ``.grad``
        (every local block's), as torch's ``register_post_accumulate_grad_hook``.

        >>> mesh = DeviceMesh.cpu(2, "tp")
        >>> p = torch.nn.Parameter(shardwise.tensor(torch.ones(4), sharding=PlacementMapping(
        ...     mesh, [Sharded(0)])))
        >>> seen = []
        >>> h = p.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.to_torch()))
        >>> (p * 3).sum().backward()
        >>> seen[0].tolist()
        [3.0, 3.0, 3.0, 3.0]
        """
        if not self.is_leaf:
            raise RuntimeError("post accumulate grad hooks cannot be registered on non-leaf "
                               "tensors")
        self._hookable("register_post_accumulate_grad_hook")
        whole = self._whole
        if whole is not None:
            return whole.register_post_accumulate_grad_hook(lambda _: hook(self))
        return _on_every_block(self.unique_shards()[1], "register_post_accumulate_grad_hook",
                               lambda s, _: hook(self))

    def retain_grad(self) -> None:
        """Keep this non-leaf tensor's gradient in ``.grad`` after the backward (a leaf
        keeps it anyway), as torch's ``retain_grad``."""
        whole = self._whole
        if whole is not None and not self._layout.is_partial:
            whole.retain_grad()
            return
        for s in self.unique_shards()[1]:
            s.retain_grad()

    @property
    def retains_grad(self) -> bool:
        whole = self._whole
        if whole is not None and not self._layout.is_partial:
            return whole.retains_grad
        return any(s.retains_grad for s in self.unique_shards()[1])

    def _hookable(self, what: str) -> None:
        if self._layout.is_partial:
            raise ShardingError(
                f"{what} on {self!r}, whose layout is Partial: its gradient has no single "
                "per-device form. Reduce it first (x.relayout(...) to a layout without "
                "Partial axes) and hook the result.")

    def _check_new_grad(self, out: Any) -> None:
        if not isinstance(out, type(self)) or out.shape != self.shape or out.mesh != self.mesh:
            raise ShardingTypeError(
                f"A register_hook hook on {self!r} returned {out!r:.120}: a new gradient must "
                f"be a shardwise.Tensor of shape {tuple(self._shape)} on {self.mesh!r} (e.g. "
                "g * 2 of the gradient it was given), or None to keep it.")

    def _whole_of(self, out: Any) -> torch.Tensor:
        """A hook's new gradient as this tensor's whole value (a plain tensor)."""
        self._check_new_grad(out)
        return out._whole if out._whole is not None else out._global()

    def _block_of(self, out: Any, s: torch.Tensor) -> torch.Tensor:
        """A hook's new gradient, at the device of local block ``s``."""
        self._check_new_grad(out)
        g = out.relayout(self._grad_layout())
        k = next(k for k in self._unique() if self._shards[k] is s)
        block = g._shards[k]
        assert block is not None
        return block

    def _roots(self) -> Self:
        """This value with Partial axes reduced (the differentiable global)."""
        if not self._layout.is_partial:
            return self
        target = self._layout.without_partial()
        if self._whole is not None:  # the whole is the reduced value already
            return type(self).from_whole(cache.whole(self, target), target, self._open)
        return cache.relayout(self, target)


def _on_every_block(blocks: list[torch.Tensor], register: str,
                    last: Callable[[torch.Tensor, dict[int, Any]], Any]) -> _Handles:
    """Register a hook (``register``: the torch method's name) on every distinct block;
    once each block's has run in a backward, the last one returns ``last(block, got)``,
    ``got`` holding every block's hook argument by the block's id (autograd reaches
    the blocks one by one)."""
    got: dict[int, Any] = {}

    def on_block(s: torch.Tensor, arg: Any) -> Any:
        got[id(s)] = arg
        if len(got) < len(blocks):
            return None
        every = dict(got)
        got.clear()
        return last(s, every)
    return _Handles([getattr(s, register)(functools.partial(on_block, s)) for s in blocks])


class _Handles:
    """The handles of one hook registered on several blocks: ``remove()`` removes every
    one (as torch's ``RemovableHandle``, also as a context manager)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def __enter__(self) -> _Handles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
