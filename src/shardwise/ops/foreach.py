"""torch's ``_foreach_*`` ops (``torch.optim``, ``clip_grad_norm_``) on lists of shardwise
Tensors.

Invariants:
- ``torch._foreach_op(lists...)`` is torch's foreach op once, on the local pieces,
  where every tensor of the first list is a shardwise Tensor with no Partial axis and
  the other lists' tensors are laid out like it (or are numbers); the op is
  elementwise, so each result keeps its tensor's layout (``torch.optim``'s foreach
  path: one call a step and op, not one per parameter). Otherwise, and under
  autograd, it is the per-tensor op over the lists, each call routed as usual, so
  each tensor keeps its own layout and its own rule.
- An in-place ``_foreach_op_`` writes each tensor (batched, or through the in-place
  handlers) and returns its first list, as torch's does; one without a per-tensor op
  raises, naming the loop.
- ``_foreach_norm`` is the exception: each tensor's reduction stays Partial, the
  reductions with one layout are stacked and reduced together (one all_reduce per
  distinct group of mesh axes, not one per tensor), then each norm is finished; the
  values are the per-tensor ``vector_norm``'s.
- shardwise Tensors are foreach-capable for ``torch.utils._foreach_utils`` (as DTensor
  registers itself), so ``clip_grad_norm_`` and ``get_total_norm`` take that path by
  default.
- The fused optimizer kernels (``torch._fused_adamw_``..., what ``torch.optim``'s
  ``fused=True`` calls, torchtitan's default) run once, on the lists of every
  parameter's local buffers with its gradient's and state's pieces at the same place:
  the kernel is elementwise per parameter, so the values are single-device torch's.
  Each parameter's gradient and state are laid out like it (what autograd and
  ``zeros_like`` give); a Partial parameter or another layout is refused, naming it.
  Plain torch parameters in the same lists pass through as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.utils._foreach_utils as foreach_utils

from shardwise.ops.reductions import norm_reduction
from shardwise.ops.registry import TensorMethod, register
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.tensors.tensor import Tensor, pieces

__all__: list[str] = []


def _foreach(name: str) -> Callable[..., Any]:
    """``torch._foreach_op(lists...)`` as the per-tensor op over the lists."""
    base = name[len("_foreach_"):]
    inplace = base.endswith("_")
    plain = base.rstrip("_")
    per: Any = getattr(TensorMethod, base, None) if inplace else (
        getattr(torch, base, None) or getattr(TensorMethod, base, None))
    if base == "norm":
        per = torch.linalg.vector_norm
    if per is None and inplace and hasattr(torch, plain):
        op = getattr(torch, plain)

        def per(x: Any, *args: Any, **kwargs: Any) -> Any:
            return x.copy_(op(x, *args, **kwargs))
    if per is None:
        def per(*args: Any, **kwargs: Any) -> Any:
            raise ShardingError(f"torch.{name} has no shardwise rule; loop over the tensors "
                                "with the per-tensor op instead.")

    def handler(*args: Any, **kwargs: Any) -> Any:
        if base not in _NOT_ELEMENTWISE:
            done = _batched(name, inplace, args, kwargs)
            if done is not _LOOP:
                return done
        n = len(args[0])
        out = []
        for i in range(n):
            call = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
            kw = kwargs
            if plain in ("addcmul", "addcdiv") and len(call) > 3:  # value is keyword-only
                kw = {**kwargs, "value": call.pop()}
            out.append(per(*call, **kw))
        return args[0] if inplace else out

    return handler


def _columns(first: Sequence[Any], others: Sequence[Sequence[Any]], plain: bool = False
             ) -> tuple[list[list[Any]], list[int]] | int:
    """The local pieces of the lists' tensors, a list per list (``first``, then
    ``others``, of its length): each tensor of ``first``'s buffers with the others'
    tensors' pieces at the same place (:func:`~shardwise.tensors.tensor.pieces`), and
    how many each tensor of ``first`` has; or the index of the first tensor whose lists
    do not line up. ``plain``: a plain torch tensor of ``first`` with no shardwise
    Tensor beside it passes as it is."""
    cols: list[list[Any]] = [[] for _ in range(1 + len(others))]
    counts = []
    for i, t in enumerate(first):
        row = [o[i] for o in others]
        if isinstance(t, Tensor):
            rows = pieces(t, row)
        else:
            rows = [(t, row)] if plain and not any(isinstance(x, Tensor) for x in row) else None
        if rows is None:
            return i
        for b, at in rows:
            cols[0].append(b)
            for col, x in zip(cols[1:], at):
                col.append(x)
        counts.append(len(rows))
    return cols, counts


#: foreach ops that are not elementwise (their results have other shapes)
_NOT_ELEMENTWISE = {"norm", "max"}
_LOOP = object()  # (the per-tensor loop: not batched)


def _batched(name: str, inplace: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.<name>`` once on the local pieces of every tensor of the lists (module
    doc), its results (out of place) as Tensors in their tensors' layouts; ``_LOOP``
    where that does not hold."""
    first = args[0] if args else None
    if not isinstance(first, (list, tuple)) or not first:
        return _LOOP
    n = len(first)
    lists = [isinstance(a, (list, tuple)) for a in args]
    for a, is_list in zip(args, lists):
        if (is_list and len(a) != n) or (not is_list and isinstance(a, Tensor)):
            return _LOOP
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return _LOOP
    got = _columns(first, [a for a, is_list in zip(args[1:], lists[1:]) if is_list])
    if isinstance(got, int):
        return _LOOP
    cols, counts = got
    if torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for col in cols for x in col):
        return _LOOP  # (autograd: the per-tensor ops record it)
    found = iter(cols)
    call = [next(found) if is_list else a for a, is_list in zip(args, lists)]
    out = getattr(torch, name)(*call, **kwargs)
    if inplace:
        return first  # (torch's in-place foreach ops return their first list)
    results = iter(out)
    made = []
    for t, c in zip(first, counts):
        mine = iter([next(results) for _ in range(c)])
        made.append(t.map_buffers(lambda _, mine=mine: next(mine)))
    return made


for _name in dir(torch):
    if _name.startswith("_foreach_"):
        register(getattr(torch, _name))(_foreach(_name))


@register(torch._foreach_norm)
def foreach_norm(tensors: Any, ord: Any = 2, dtype: Any = None) -> list[Any]:
    """The norm of each tensor, the shardwise ones' reductions reduced together: one
    all_reduce per distinct layout of the reductions (the mesh axes that shard them).

    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> rows = PlacementMapping(mesh, [Sharded(0), Replicated()])
    >>> both = PlacementMapping(mesh, [Sharded(0), Sharded(1)])
    >>> ts = [shardwise.tensor(torch.ones(4, 4), sharding=s) for s in (rows, both, both)]
    >>> with shardwise.debug.CommCounter() as cc:
    ...     norms = torch._foreach_norm(ts)
    >>> [float(n) for n in norms], cc.counts   # over dp; over dp and tp (two tensors)
    ([4.0, 4.0, 4.0], Counter({'all_reduce': 2}))
    """
    out: list[Any] = [None] * len(tensors)
    # stacked only with the same layout and dtype (stack would promote a mix)
    groups: dict[tuple[Layout, Any], list[tuple[int, Any, Callable[[Any], Any]]]] = {}
    for i, x in enumerate(tensors):
        if not isinstance(x, Tensor):
            out[i] = torch.linalg.vector_norm(x, ord, dtype=dtype)
            continue
        total, finish = norm_reduction(x, ord, dtype=dtype)
        groups.setdefault((total.dist_layout, total.dtype), []).append((i, total, finish))
    for (layout, _), members in groups.items():
        stacked = cast(Tensor, torch.stack([total for _, total, _ in members]))
        # one collective for the group (a no-op when nothing is Partial)
        norms = members[0][2](stacked.relayout(Layout.replicated(layout.mesh, 1)))
        for j, (i, _, _) in enumerate(members):
            out[i] = norms[j]
    return out


def _fused(name: str) -> Callable[..., Any]:
    """``torch._fused_<optimizer>_(params, grads, states..., **options)``: the kernel once,
    on the parameters' local buffers and their lists' pieces at the same place."""

    def handler(params: Any, *lists: Any, **kwargs: Any) -> None:
        for k, v in kwargs.items():
            if isinstance(v, Tensor):
                raise ShardingError(
                    f"torch.{name}: option {k}= is a shardwise.Tensor ({v!r:.80}); the "
                    "kernel takes it as a plain tensor. Pass v.to_torch().")
        used = [lst for lst in lists if len(lst)]  # (sgd: no momentum list)
        # (plain parameters beside shardwise ones: their own tensors as they are)
        got = _columns(params, used, plain=True)
        if isinstance(got, int):
            raise _unfused(name, got, params[got], [lst[got] for lst in used])
        found = iter(got[0][1:])
        getattr(torch, name)(got[0][0], *(next(found) if len(lst) else lst
                                          for lst in lists), **kwargs)

    return handler


def _unfused(name: str, n: int, p: Any, row: list[Any]) -> ShardingError:
    if isinstance(p, Tensor) and p.dist_layout.is_partial:
        return ShardingError(
            f"torch.{name}: parameter {n} is Partial ({p.dist_layout}): its devices hold "
            "addends, so an update would not apply to the value. Reduce it first "
            "(shardwise.all_reduce), or keep it out of the optimizer.")
    what = ", ".join(str(x.dist_layout) if isinstance(x, Tensor) else type(x).__name__
                     for x in (p, *row))
    return ShardingError(
        f"torch.{name}: parameter {n}, its gradient and its state ({what}) are not laid "
        "out alike; the fused kernel runs on each parameter's local pieces. Give the "
        "gradient and state the parameter's layout (p.grad = g.redistribute(...)), keep "
        "every parameter a shardwise Tensor or none of its tensors, or use the optimizer "
        "with fused=False.")


for _name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
    if hasattr(torch, _name):
        register(getattr(torch, _name))(_fused(_name))


def _foreach_capable() -> None:
    """Let ``torch.utils._foreach_utils._has_foreach_support`` accept shardwise Tensors
    (DTensor appends itself likewise), so ``clip_grad_norm_``'s default path is
    ``_foreach_norm`` above instead of one ``vector_norm`` (one all_reduce) per gradient."""
    if Tensor not in foreach_utils._foreach_supported_types:
        # typed as torch.Tensor types; shardwise's Tensor is a torch.Tensor at run time
        foreach_utils._foreach_supported_types.append(Tensor)  # type: ignore[arg-type]


_foreach_capable()
