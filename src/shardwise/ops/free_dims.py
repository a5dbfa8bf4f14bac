"""The runner of the ``"free_dims"`` rule: ops whose operand dims either shard freely or stay
whole (conv, pools, norms, pads, fft, gather/scatter, random ops drawn once).

Invariants:
- ``apply_free_dims(name, fn, args, free, outs)`` runs ``fn(*args)`` through the rule
  table's ``"free_dims"`` rule: ``free[i][d] == k >= 0`` names a factor that shards freely
  (the op treats each index of that dim alone: batch, channels, fft's other dims), the
  same ``k`` on every operand and output; ``-1`` keeps the dim whole (the planner
  gathers it first, which is a rule: nothing gathers inside a handler).
- The output shapes come from one call of ``fn`` on meta tensors, so ``fn`` is torch's
  own op (its bits on each block) and never consumes the random generator there.
- Entries of ``args`` that are not tensors (None, numbers, strings) reach ``fn`` as they
  are; plain torch tensors are Replicated operands; 0-d tensors are constants.
- ``fn`` may return a tuple (values and indices, norms' statistics): one layout decision
  and one local call per block give every result; each further result's dims name
  factors of the first result's (or stay whole), so its layout is the first's.
- Every factor an operand shards freely appears in the first result: no Partial.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.ops.execute import apply, companion
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.tensors.tensor import Tensor

__all__ = ["apply_free_dims", "lead"]

Free = Sequence[int]


def lead(ndim: int, k: int, start: int = 0) -> tuple[int, ...]:
    """Factor ids of a rank-``ndim`` dim list whose first ``k`` dims shard freely (as
    factors ``start``, ``start + 1``...) and whose others stay whole.

    >>> lead(4, 1), lead(3, 2), lead(2, 0)
    ((0, -1, -1, -1), (0, 1, -1), (-1, -1))
    """
    k = max(0, min(k, ndim))
    return tuple(range(start, start + k)) + (-1,) * (ndim - k)


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_meta(v) for v in x)
    return x


def _results(r: Any) -> list[torch.Tensor]:
    if isinstance(r, torch.Tensor):
        return [r]
    return [v for v in r if isinstance(v, torch.Tensor)]


def _rebuild(r: Any, values: list[Any]) -> Any:
    """``r``'s structure (a tensor, tuple or torch's named tuple) holding ``values``."""
    if isinstance(r, torch.Tensor):
        return values[0]
    it = iter(values)
    out = [next(it) if isinstance(v, torch.Tensor) else v for v in r]
    return type(r)(out)  # a tuple, or torch's named tuple (built from a sequence)


def apply_free_dims(name: str, fn: Callable[..., Any], args: Sequence[Any],
                    free: Sequence[Free | None], outs: Sequence[Free] | None = None) -> Any:
    """``fn(*args)`` with ``args[i]``'s dims laid out as ``free[i]`` (see the module
    invariants) and result ``j``'s dims as ``outs[j]`` (default: every result's dims
    whole). Returns ``fn``'s structure holding shardwise Tensors.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor(torch.ones(4, 3, 5), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> w = torch.ones(2, 3, 2)
    >>> y = apply_free_dims("conv1d", torch.conv1d, [x, w], [lead(3, 1), lead(3, 0)], [lead(3, 1)])
    >>> tuple(y.shape), str(y.dist_layout), bool((y.to_torch() == 6).all())
    ((4, 2, 4), 'DeviceMesh(x=2)[S(x), R, R]', True)
    """
    spec = _meta_call(name, fn, args)
    shapes = [tuple(t.shape) for t in _results(spec)]
    outs = list(outs) if outs is not None else []
    outs += [(-1,) * len(s) for s in shapes[len(outs):]]
    at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)
          and (a.ndim > 0 or isinstance(a, Tensor))]
    operands = [args[i] for i in at]
    kinds = tuple(tuple(free[i] or ()) if args[i].ndim else () for i in at)
    out = tuple((k, n) for k, n in zip(outs[0], shapes[0]))
    extras: dict[int, list[torch.Tensor]] = {}

    def local(*blocks: Any) -> torch.Tensor:
        call = list(args)
        for i, b in zip(at, blocks):
            call[i] = b
        rs = _results(fn(*call))
        extras[id(rs[0])] = rs[1:]
        return rs[0]

    try:
        first = apply("free_dims", operands, local, kinds, out)
    except ShardingError as err:
        raise ShardingError(f"{name}: {err}") from err
    if len(shapes) == 1:
        return _rebuild(spec, [first])
    return _rebuild(spec, [first, *_extra_results(first, extras, outs, shapes)])


def _meta_call(name: str, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    try:
        return fn(*[_meta(a) for a in args])
    except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as err:
        shown = [list(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
        if isinstance(err, (RuntimeError, NotImplementedError)) and "meta" in str(err).lower():
            raise ShardingError(f"{name}: the output shape of {shown} cannot be computed "
                                f"without the values ({err}).") from err
        raise  # torch's own error for bad arguments, as single-device torch raises it


def _extra_results(first: Tensor, extras: dict[int, list[torch.Tensor]],
                   outs: Sequence[Free], shapes: list[tuple[int, ...]]) -> list[Tensor]:
    """The further results of each block's call, laid out by their factors: a factor of
    the first result keeps its mesh axes, a whole dim has none."""
    lay = first.dist_layout
    where = {k: d for d, k in enumerate(outs[0]) if k >= 0}
    result = []
    for j in range(len(outs) - 1):
        dims = tuple(lay.dims[where[k]] if k >= 0 else () for k in outs[j + 1])
        layout = Layout(lay.mesh, dims, (None,) * lay.mesh.ndim)
        # held as the first result is: each of its buffers' companion
        held = first.held.map(functools.partial(companion, extras, j), layout)
        got = held.first()
        assert got is not None
        result.append(Tensor.from_held(held, layout, torch.Size(shapes[j + 1]), got.dtype,
                                       got.device, None))
    return result
