"""The executor shared by every compute op: bind, decide, reshard, run locally.

Invariants:
- The torch op runs once per distinct tuple of input shard objects, and that
  one result serves every device holding that tuple: replicas keep sharing one
  buffer, so simulated gradients are exact (no N-fold overcount).
- Python numbers and 0-d torch tensors are broadcast constants: replicated,
  never communicated (a 0-d tensor that requires grad is placed on the mesh).
- Where an operand is replicated over a mesh axis but the output is not, each
  device computes only a share of that operand's gradient; the backend's
  ``diverge`` sums the shares (identity in the simulated runtime).
- Every output block has the shape the output layout's split rule gives
  (asserted).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.ops.binding import Factors, bind
from shardwise.ops.propagation import Decision, decide
from shardwise.runtime import backend_for
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.tensors import Tensor

__all__ = ["apply"]


def _is_const(x: Any) -> bool:
    return (isinstance(x, numbers.Number)
            or (isinstance(x, torch.Tensor) and x.ndim == 0))


def _operands(op: str, operands: Sequence[Any]) -> list[Any]:
    """The operands, checked: Tensors on one mesh, or constants."""
    first = next((x for x in operands if isinstance(x, Tensor)), None)
    if first is None:
        raise ShardingTypeError(
            f"{op} needs at least one shardwise.Tensor operand. Got "
            f"{[type(x).__name__ for x in operands]}; wrap data with shardwise.tensor(...)."
        )
    mesh = first.mesh
    out = list(operands)
    for i, x in enumerate(out):
        if isinstance(x, Tensor):
            if x.mesh is not mesh and x.mesh != mesh:
                raise ShardingError(
                    f"{op}: operand {i} lives on {x.mesh!r} but operand 0 on {mesh!r}; "
                    "compute ops need one mesh. Move one with "
                    "shardwise.to_device(x, sharding=...) first."
                )
        elif isinstance(x, torch.Tensor) and x.ndim > 0:
            # a plain torch tensor among shardwise ones: Replicated on the mesh (as JAX
            # treats numpy arrays); every process must hold the same value
            from shardwise.creation import place

            out[i] = place(x, Layout.replicated(mesh, x.ndim))
        elif not _is_const(x):
            raise ShardingTypeError(
                f"{op}: operand {i} is a {type(x).__name__}; operands are shardwise "
                "Tensors, torch tensors or Python numbers. Wrap it with "
                "shardwise.tensor(x, sharding=...) first."
            )
        elif isinstance(x, torch.Tensor) and x.requires_grad:
            from shardwise.creation import place

            out[i] = place(x, Layout.replicated(mesh, 0))
    return out


_NONE = id(None)


def apply(op: str, operands: Sequence[Any], fn: Callable[..., torch.Tensor], *params: Any,
          shaped: bool = False) -> Tensor:
    """Run ``op`` (rule ``RULES[op]`` with ``params``) as ``fn`` on the local shards;
    ``shaped``: ``fn`` also takes the expected local output shape."""
    args = _operands(op, operands)
    shapes: list[tuple[int, ...]] = []
    layouts: list[Layout | None] = []
    opens: list[tuple[bool, ...] | None] = []
    itemsizes: list[int] = []
    for x in args:
        if isinstance(x, Tensor):
            shapes.append(x.shape)
            layouts.append(x.dist_layout)
            opens.append(x._open)
            itemsizes.append(x.dtype.itemsize)
        else:
            shapes.append(())
            layouts.append(None)
            opens.append(())
            itemsizes.append(0)
    factors = bind(op, tuple(shapes), *params)
    dec = decide(factors, tuple(layouts), tuple(opens), tuple(itemsizes))
    cols: list[Sequence[torch.Tensor | None] | None] = []
    for i, x in enumerate(args):
        if layouts[i] is None:
            cols.append(None)
            continue
        req = dec.required[i]
        assert req is not None
        shards: Sequence[torch.Tensor | None] = (
            x.shards if req is layouts[i] else x.relayout(req).shards)
        if dec.diverge[i]:
            shards = backend_for(req.mesh).diverge(shards, req,  # type: ignore[arg-type]
                                                   dec.diverge[i])
        cols.append(shards)
    return _run_local(op, fn, args, cols, dec, factors, shaped)


def _run_local(op: str, fn: Callable[..., torch.Tensor], args: list[Any],
               cols: list[Sequence[torch.Tensor | None] | None], dec: Decision,
               factors: Factors, shaped: bool) -> Tensor:
    where = [i for i, c in enumerate(cols) if c is not None]
    plain = len(where) == len(args) and not shaped  # every operand a Tensor: call fn(*row)
    expect = dec.local_shapes
    memo: dict[tuple[int, ...], torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    for k, row in enumerate(zip(*(cols[i] for i in where))):
        key = tuple(map(id, row))
        r = memo.get(key)
        if r is None:
            if _NONE in key:  # a device another process holds
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
            assert tuple(r.shape) == expect[k], (
                f"{op}: device {k} computed a block of shape {tuple(r.shape)}, the layout "
                f"{dec.output} gives {expect[k]}")
            memo[key] = r
        out.append(r)
    dtype = None if memo else _meta_dtype(fn, args, dec, shaped)
    return Tensor(out, dec.output, factors.out_shape, dtype, open_dims=dec.out_open)


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
