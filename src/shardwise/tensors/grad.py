"""A Tensor's autograd, seen globally: flags, gradients, detaching.

:class:`GradMixin` (a base of :class:`shardwise.tensors.tensor.Tensor`) shows the global
view of autograd, which runs on the local blocks or on the whole value (torch
records each local op), as torch's own properties do for a plain tensor.

Invariants:
- Autograd runs on the buffers of what the runtime holds (``Local.buffers``: the
  whole value, one node per op, torch's own arithmetic, the blocks cut from it views
  autograd flows through; else the distinct blocks); the wrapper's C-level
  ``requires_grad`` stays False. Every property and hook here reads the buffers, so
  none asks which.
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
from collections.abc import Callable, Sequence
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

    # Autograd runs on what the runtime holds (the whole value, or the blocks); these
    # properties show the global view of it, as torch's do for a plain tensor.
    @property
    def requires_grad(self) -> bool:
        return self._local.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        # (already so: kept as held; torch's fake conversion sets the flag it just
        # built, and a Partial leaf made anew would be its blocks, not its whole)
        if value != self._local.requires_grad:
            self.requires_grad_(value)

    @property
    def is_leaf(self) -> bool:
        return self._local.is_leaf

    @property
    def grad_fn(self) -> Any:
        """The autograd node of the whole value or the first local shard (None for leaves)."""
        return self._local.grad_fn

    def requires_grad_(self, requires_grad: bool = True) -> Self:
        """Make this tensor a leaf that records gradients (in place on the flag only)."""
        if not self.is_leaf:
            if not requires_grad:
                raise ShardingError(
                    "requires_grad_(False) on a non-leaf tensor: it is the result of an op "
                    "that records gradients. Use x.detach()."
                )
            return self
        self._local = self._local.with_grad(requires_grad, self._layout)
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
        local = new._local.with_grad(True, new._layout) if grad else new._local
        self._local = local
        self._layout, self._dtype = new._layout, new._dtype
        self._shape, self._size, self._open = new._shape, new._size, new._open
        self._device = new._device
        # keep the C-level metadata (dtype, shape) that torch's C++ code reads in sync
        with torch._C.DisableTorchFunctionSubclass():
            torch._C.TensorBase.data.__set__(self, value)  # type: ignore[attr-defined]

    def detach(self) -> Self:
        """The same value, cut from the autograd graph (shares memory)."""
        return self.map_buffers(lambda s: s.detach())

    def _grad_layout(self) -> Layout:
        if not self._layout.is_partial:  # (the common case: a gradient in its own layout)
            return self._layout
        partial = tuple(
            None if op is None or op is ReduceOp.SUM else ReduceOp.SUM
            for op in self._layout.partial
        )
        return self._layout.with_partial(partial)

    def grads_of(self, grads: Sequence[torch.Tensor | None]) -> Self:
        """The gradients of this value's buffers (``Local.buffers``' order; None: none
        arrived) as a Tensor in its gradient layout (:meth:`_grad_layout`)."""
        layout = self._grad_layout()
        return self._held(self._local.grad_local(grads, layout), layout)

    @property
    def grad(self) -> Self | None:
        """Accumulated gradient, in this tensor's layout; None before any backward."""
        grads = self._local.grads()
        seen = self._grad_view
        if len(grads) == 1:  # one buffer (a whole value, or one block): the common case
            g = grads[0]
            if g is None:
                return None
            if seen is not None and len(seen[0]) == 1 and seen[0][0] is g:
                return seen[1]
        elif all(g is None for g in grads):
            return None
        # the same gradients give the same Tensor (optimizers read .grad often)
        if seen is not None and len(seen[0]) == len(grads) and all(
                a is b for a, b in zip(seen[0], grads)):
            return seen[1]
        out = self.grads_of(grads)
        self._grad_view = (grads, out)
        return out

    @grad.setter
    def grad(self, value: Self | None) -> None:
        """``p.grad = None`` (what ``zero_grad()`` does) or a Tensor of ``p``'s shape."""
        if value is None:
            self._local.set_grads(None, self._layout)
            self._grad_view = None  # (it held the old gradients: they would stay alive)
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
        if value.mesh != self.mesh:
            raise ShardingError(
                f"p.grad lives on {value.mesh!r} but p on {self.mesh!r}: move it with "
                "shardwise.to_device(g, sharding=p.sharding) first."
            )
        g = value.detach().relayout(self._layout)
        self._local.set_grads(g._local, self._layout)
        self._grad_view = None

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
        buffers = self._local.buffers()

        def on_last(i: int, grads: list[Any]) -> torch.Tensor | None:
            out = hook(self.grads_of(grads))
            if out is None:
                return None
            if len(buffers) > 1:
                raise ShardingError(
                    f"A hook on {self!r} returned a new gradient, but autograd runs on its "
                    f"{len(buffers)} local blocks one by one (a result on the simulated "
                    "mesh) and the others have passed already: a hook may only observe "
                    "such a gradient. Change it where it arrives (a leaf's hook, or .grad "
                    "after the backward); a leaf from shardwise.tensor(...) runs autograd "
                    "on one whole value, and under torchrun on each process's one block, "
                    "where a hook may replace it.")
            self._check_new_grad(out)
            layout = self._grad_layout()
            return self._local.part(out.relayout(layout)._local, i, layout)
        return _on_every_buffer(buffers, "register_hook", on_last)

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
        return _on_every_buffer(self._local.buffers(), "register_post_accumulate_grad_hook",
                                lambda i, _: hook(self))

    def retain_grad(self) -> None:
        """Keep this non-leaf tensor's gradient in ``.grad`` after the backward (a leaf
        keeps it anyway), as torch's ``retain_grad``."""
        for b in self._local.buffers():
            b.retain_grad()

    @property
    def retains_grad(self) -> bool:
        return any(b.retains_grad for b in self._local.buffers())

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

    def reduced(self) -> Self:
        """This value with Partial axes reduced (differentiable; the same Tensor where
        it has none): what backward starts from."""
        if not self._layout.is_partial:
            return self
        return cache.relayout(self, self._layout.without_partial())


def _on_every_buffer(buffers: Sequence[torch.Tensor], register: str,
                     last: Callable[[int, list[Any]], Any]) -> _Handles:
    """Register a hook (``register``: the torch method's name) on every buffer; once
    each buffer's has run in a backward, the last one returns ``last(i, got)``, ``i``
    its index and ``got`` every buffer's hook argument in order (autograd reaches the
    buffers one by one)."""
    got: dict[int, Any] = {}

    def on_buffer(i: int, arg: Any) -> Any:
        got[i] = arg
        if len(got) < len(buffers):
            return None
        every = [got[j] for j in range(len(buffers))]
        got.clear()
        return last(i, every)
    return _Handles([getattr(b, register)(functools.partial(on_buffer, i))
                     for i, b in enumerate(buffers)])


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
