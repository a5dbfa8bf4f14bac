"""Running a decided op (:mod:`shardwise.ops.execute` decides): the torch op on the
local blocks, or once on the operands' whole values, and the result wrapped.

Invariants:
- The torch op runs once per distinct tuple of input block objects, and that one
  result serves every device holding that tuple: replicas keep sharing one buffer,
  so simulated gradients are exact (no N-fold overcount).
- Every output block has the shape the output layout's split rule gives (asserted).
- A device another process holds is None in every operand (one mesh) and in the
  result; a process holding no device of the mesh gets the dtype from meta.
- A whole-value run whose result aliases a derived copy (a view) returns None: the
  caller runs the op on the blocks, whose views alias the operand's blocks.
- Failures of the torch op become ``ShardingError`` naming the op, the local blocks,
  the global shapes and the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.propagation.binding import Factors
from shardwise.propagation.decide import Decision
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.tensors import cache
from shardwise.tensors.tensor import Tensor

__all__: list[str] = []

_NONE = id(None)


def _run_plain(op: str, fn: Callable[..., torch.Tensor], operands: Sequence[Tensor],
               dec: Decision, factors: Factors, size: torch.Size,
               out: list[torch.Tensor | None] | None = None,
               memo: dict[tuple[int, ...], torch.Tensor] | None = None) -> Tensor:
    """:func:`_run_local` where every operand is a Tensor in its required layout and
    ``fn`` takes the blocks alone: one call per distinct row of blocks (a device
    another process holds has None in every operand: one mesh). ``out`` and ``memo``:
    the first rows, already run (by the decision cache's hit path), and their results
    by row (the blocks' ids)."""
    expect = dec.local_shapes
    out = [] if out is None else out
    memo = {} if memo is None else memo
    start = len(out)
    rows = zip(*[x._blocks if x._whole is None else x._shards for x in operands])
    for k, row in enumerate(rows):
        if k < start:
            continue
        if row[0] is None:  # (None in every operand: one mesh)
            out.append(None)
            continue
        key = tuple(map(id, row))
        r = memo.get(key)
        if r is None:
            try:
                r = memo[key] = fn(*row)
            except (RuntimeError, TypeError, ValueError, IndexError) as err:
                raise _failed(op, operands, k, factors, err) from err
            if r.shape != expect[k]:
                raise AssertionError(_misshapen(op, k, r, dec))
        out.append(r)
    if not memo:  # no device of this mesh here: the dtype from meta
        return Tensor(out, dec.output, factors.out_shape,
                      _meta_dtype(fn, list(operands), dec, False), open_dims=dec.out_open)
    first = next(iter(memo.values()))
    return Tensor._wrap(tuple(out), None, dec.output, size, first.dtype, first.device,
                        dec.out_open, factors.out_shape)


def _failed(op: str, operands: Sequence[Tensor], k: int, factors: Factors,
            err: Exception) -> ShardingError:
    """The error of ``op`` failing on device ``k``'s blocks (raise it from ``err``)."""
    blocks = [tuple(x.shards[k].shape) for x in operands]
    return ShardingError(
        f"{op} failed on the local blocks {blocks} of operands with global "
        f"shapes {_shapes(list(operands))} (rule '{factors.text}'): {err}")


def _misshapen(op: str, k: int, r: torch.Tensor, dec: Decision) -> str:
    return (f"{op}: device {k} computed a block of shape {tuple(r.shape)}, the layout "
            f"{dec.output} gives {dec.local_shapes[k]}")


def _run_local(op: str, fn: Callable[..., torch.Tensor], args: list[Any],
               cols: list[Sequence[torch.Tensor | None] | None], dec: Decision,
               factors: Factors, shaped: bool, size: torch.Size | None = None) -> Tensor:
    where = [i for i, c in enumerate(cols) if c is not None]
    plain = len(where) == len(args) and not shaped  # every operand a Tensor: call fn(*row)
    expect = dec.local_shapes
    memo: dict[Any, torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    single = len(where) == 1
    picked = [cols[i] for i in where]
    for k, row in enumerate(zip(*picked)):
        key: Any = id(row[0]) if single else tuple(map(id, row))
        r = memo.get(key)
        if r is None:
            if key == _NONE or (not single and _NONE in key):  # another process's device
                out.append(None)
                continue
            if plain:
                call = row
            else:
                call = list(args)
                for i, s in zip(where, row):
                    call[i] = s
                if shaped:
                    call.append(expect[k])
            try:
                r = fn(*call)
            except (RuntimeError, TypeError, ValueError, IndexError) as err:
                blocks = [tuple(a.shape) for a in call if isinstance(a, torch.Tensor)]
                raise ShardingError(
                    f"{op} failed on the local blocks {blocks} of operands with global "
                    f"shapes {_shapes(args)} (rule '{factors.text}'): {err}"
                ) from err
            assert r.shape == expect[k], (
                f"{op}: device {k} computed a block of shape {tuple(r.shape)}, the layout "
                f"{dec.output} gives {expect[k]}")
            memo[key] = r
        out.append(r)
    if not memo:  # no device of this mesh here: the dtype from meta
        return Tensor(out, dec.output, factors.out_shape, _meta_dtype(fn, args, dec, shaped),
                      open_dims=dec.out_open)
    r = next(iter(memo.values()))
    return Tensor._wrap(tuple(out), None, dec.output,
                        torch.Size(factors.out_shape) if size is None else size, r.dtype,
                        r.device, dec.out_open)


def _run_whole(op: str, fn: Callable[..., torch.Tensor], args: list[Any],
               layouts: Sequence[Layout | None], dec: Decision, factors: Factors,
               shaped: bool, views: dict[int, torch.Tensor] | None = None) -> Tensor | None:
    """``fn`` once on the operands' whole values (own or derived): the global op, one
    autograd node. Layout changes of the operands keep their wholes (their
    collectives are counted). None when the result aliases a derived copy (a view):
    the op then runs on the blocks, whose views alias them."""
    call = []
    derived = False
    for i, (x, have, req, div) in enumerate(zip(args, layouts, dec.required, dec.diverge)):
        if have is None:
            call.append(x)
            continue
        assert req is not None
        derived = derived or x._whole is None
        call.append(cache.whole(x, req, div, views.get(i) if views else None))
    if shaped:
        call.append(factors.out_shape)
    try:
        r = fn(*call)
    except (RuntimeError, TypeError, ValueError, IndexError) as err:
        blocks = [tuple(a.shape) for a in call if isinstance(a, torch.Tensor)]
        raise ShardingError(  # the whole values are this process's one local block each
            f"{op} failed on the local blocks {blocks} of operands with global shapes "
            f"{_shapes(args)} (rule '{factors.text}'): {err}"
        ) from err
    assert tuple(r.shape) == factors.out_shape, (
        f"{op}: the whole result has shape {tuple(r.shape)}, the rule gives "
        f"{factors.out_shape}")
    if derived and _aliases_copy(args, call, r):
        return None
    # the operands' wholes live on this mesh's one torch device: no check needed
    return Tensor._wrap(None, r, dec.output, r.shape, r.dtype, r.device, dec.out_open)


def _aliases_copy(operands: Sequence[Any], call: Sequence[Any], r: torch.Tensor) -> bool:
    """Whether ``r`` is (a view of) the derived copy of an operand held as blocks
    (``call``: the wholes the op ran on)."""
    if r._base is None and not any(r is c for c in call):
        return False  # a new tensor (the common case): aliases nothing
    return any(isinstance(x, Tensor) and cache.aliases_copy(x, r) for x in operands)


def _shapes(args: list[Any]) -> list[list[int]]:
    return [list(x.shape) if isinstance(x, (Tensor, torch.Tensor)) else [] for x in args]


def _meta_dtype(fn: Callable[..., torch.Tensor], args: list[Any], dec: Decision,
                shaped: bool) -> torch.dtype:
    """The output dtype on a process that holds no device of the mesh."""
    from shardwise.sharding.shapes import local_shape

    call: list[Any] = []
    for x, req in zip(args, dec.required):
        if isinstance(x, Tensor) and req is not None:
            shape = local_shape(x.shape, req, req.mesh.coord_of(0))
            call.append(torch.empty(shape, dtype=x.dtype, device="meta"))
        else:
            call.append(x)
    if shaped:
        call.append(dec.local_shapes[0])
    return fn(*call).dtype
