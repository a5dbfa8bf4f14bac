"""shard_map on the torch.distributed runtime: each lax collective is one native
collective on the process group of its mesh axes, run as a spec of the backend's one
autograd family (:mod:`shardwise.runtime.process.functions`) in shard_map's gradient
convention (``per_device``: a value replicated over the group is one per device):

    psum          AllReduce(sum)        all_reduce(sum) in backward
    pmax / pmin   AllReduce(max/min)    the summed gradient to the argmax (ties split)
    all_gather    AllGather             reduce_scatter(sum) in backward
    psum_scatter  ReduceScatter(sum)    all_gather in backward
    ppermute      Permute               the inverse send/recv in backward
    all_to_all    AllToAll              the inverse all_to_all in backward
    ragged_all_to_all  AllToAll         (sizes given: no exchange of sizes)
    replicate     Diverge               all_reduce(sum) over the axes in backward
    take_first    TakeFirst             zeros in backward (off coordinate 0)

The last two are shard_map's boundaries: an input replicated over mesh axes R
feeds every device of R (its gradient is the sum of theirs); an output
replicated over R is taken from coordinate 0 along R (the others get no
gradient). Together they give the gradients of the simulated runtime exactly.

Invariants:
- Each collective runs on ``collectives.group(mesh, axes)`` with the axes in the
  order the op names them: its members (and so the pieces) follow that axis
  order, as in the simulated runtime, whatever torch's rank order.
- Uneven sizes are exchanged first (one small all_gather or send/recv of the
  sizes) for tiled all_gather, all_to_all and ppermute; equal-shape calls skip it.
- Forward-mode tangents go through the same (linear) forward.
- While torch.compile traces, those sizes are exchanged for real (the tracing modes
  off: :func:`host_ints`), so they are constants of the graph, as every rank traces
  the same program; the compiled graph exchanges no sizes.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from shardwise.runtime import SpmdOutputs, observe, spmd
from shardwise.runtime.process import collectives, functions
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import local_shape, split_size

__all__ = ["DistEnv", "replicate", "run_spmd", "spmd_outputs", "take_first"]


def sizes_of(n: int, grp: collectives.Group, device: torch.device) -> list[int]:
    """Every member's ``n`` (axis order), by one small all_gather."""
    return host_ints(lambda: collectives.all_gather(
        torch.tensor([n], dtype=torch.int64, device=device), 0, grp, [1] * grp.size,
        "lax: sizes"))


def host_ints(exchange: Callable[[], torch.Tensor]) -> list[int]:
    """The ints of a small exchange of sizes. While torch.compile traces (fake or
    functional tensors, whose values are not known) it runs for real with the
    tracing modes off: the sizes become constants of the graph."""
    if torch.compiler.is_compiling():
        with _disable_current_modes(), _eagerly():
            return [int(v) for v in exchange().tolist()]
    return [int(v) for v in exchange().tolist()]


@contextlib.contextmanager
def _eagerly() -> Iterator[None]:
    """The process runtime's eager collectives for a moment, though torch.compile is
    tracing: torch's compile flag (read by ``torch.compiler.is_compiling()``) off. (Its
    functional collectives on real tensors hung on Gloo while Dynamo traced.)"""
    flag = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = False
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = flag


# --- the lax collectives: specs of the one family (functions.py) -------------------------
def _reduce(op: ReduceOp
            ) -> Callable[[torch.Tensor, collectives.Group, tuple[Any, ...]], torch.Tensor]:
    return lambda x, grp, p: functions.run(functions.AllReduce(grp, op, "lax", per_device=True), x)


def _ppermute(x: torch.Tensor, grp: collectives.Group, pairs: tuple[tuple[int, int], ...]
              ) -> torch.Tensor:
    dst = {s: d for s, d in pairs}.get(grp.pos)
    src = {d: s for s, d in pairs}.get(grp.pos)
    tag = f"lax.ppermute {pairs}"
    keep = src is not None and src == grp.pos
    send_to = functions.KEEP if keep else None if dst is None else grp.ranks[dst]
    recv_from = functions.KEEP if keep else None if src is None else grp.ranks[src]
    # The receiver learns the sender's shape first (blocks may be uneven).
    got = host_ints(lambda: functions.Permute(
        send_to, recv_from, grp, f"{tag}: shapes of {x.dtype} blocks").forward(
            torch.tensor(list(x.shape), dtype=torch.int64, device=x.device)))
    recv_shape = (tuple(got) if recv_from not in (None, functions.KEEP) else tuple(x.shape))
    return functions.run(
        functions.Permute(send_to, recv_from, grp, tag, (tuple(x.shape), recv_shape)), x)


def _all_gather(x: torch.Tensor, grp: collectives.Group, params: tuple[Any, ...]) -> torch.Tensor:
    dim, even = params
    sizes = [x.shape[dim]] * grp.size if even else sizes_of(x.shape[dim], grp, x.device)
    return functions.run(functions.AllGather(dim, grp, sizes, "lax", per_device=True), x)


def _psum_scatter(x: torch.Tensor, grp: collectives.Group, params: tuple[Any, ...]) -> torch.Tensor:
    (dim,) = params
    sizes = [split_size(x.shape[dim], grp.size, i) for i in range(grp.size)]
    return functions.run(functions.ReduceScatter(dim, grp, sizes, ReduceOp.SUM, "lax"), x)


def _all_to_all(x: torch.Tensor, grp: collectives.Group, params: tuple[Any, ...]) -> torch.Tensor:
    split, concat, even = params
    send = [split_size(x.shape[split], grp.size, j) for j in range(grp.size)]
    held = [x.shape[concat]] * grp.size if even else sizes_of(x.shape[concat], grp, x.device)
    recv = ([split_size(h, grp.size, grp.pos) for h in held] if split == concat else held)
    return functions.run(functions.AllToAll(concat, split, grp, send, recv, "lax"), x)


def _ragged(x: torch.Tensor, grp: collectives.Group, params: tuple[Any, ...]) -> torch.Tensor:
    dim, sizes = params  # every member's row: what this one receives needs no exchange
    send = list(sizes[grp.pos])
    recv = [row[grp.pos] for row in sizes]
    return functions.run(functions.AllToAll(dim, dim, grp, send, recv, "lax ragged"), x)


_OPS: dict[str, Callable[[torch.Tensor, collectives.Group, tuple[Any, ...]], torch.Tensor]] = {
    "psum": _reduce(ReduceOp.SUM),
    "pmax": _reduce(ReduceOp.MAX),
    "pmin": _reduce(ReduceOp.MIN),
    "all_gather": _all_gather,
    "psum_scatter": _psum_scatter,
    "ppermute": lambda x, grp, p: _ppermute(x, grp, p[0]),
    "all_to_all": _all_to_all,
    "ragged_all_to_all": _ragged,
}


class DistEnv:
    """The axis environment of this process (mesh device ``index``)."""

    __slots__ = ("coord", "index", "mesh")

    def __init__(self, mesh: DeviceMesh, index: int) -> None:
        self.mesh = mesh
        self.index = index
        self.coord = mesh.coord_of(index)

    def collective(self, op: str, x: torch.Tensor, axes: tuple[int, ...],
                   params: tuple[Any, ...]) -> torch.Tensor:
        grp = collectives.group(self.mesh, axes)
        if observe.active():
            observe.record(spmd.KIND[op], spmd.sent_bytes(op, x, params, grp.pos, grp.size))
        out: torch.Tensor = _OPS[op](x, grp, params)
        return out


# --- shard_map's boundaries ---------------------------------------------------------------
def replicate(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[int, ...]) -> torch.Tensor:
    """An input block that every device of ``axes`` uses (gradient summed over them)."""
    if not axes or not (x.requires_grad and torch.is_grad_enabled()):
        return x
    # identity forward, all_reduce(sum) backward: the Tensor runtime's diverge
    return functions.run(functions.Diverge(collectives.group(mesh, axes)), x)


def take_first(x: torch.Tensor, mesh: DeviceMesh, index: int, axes: tuple[int, ...]
               ) -> torch.Tensor:
    """An output block replicated over ``axes``: only coordinate 0 along them counts."""
    coord = mesh.coord_of(index)
    if all(coord[a] == 0 for a in axes) or not x.requires_grad:
        return x
    return functions.run(functions.TakeFirst(), x)


def process_index(mesh: DeviceMesh) -> int:
    """This process's device of ``mesh``, after creating every group a body may use."""
    # Group creation is collective over every process: make all the groups fn may
    # use now, on every process, in one order.
    for r in range(1, mesh.ndim + 1):
        for axes in itertools.combinations(range(mesh.ndim), r):
            collectives.group(mesh, axes)
    k = collectives.my_index(mesh)
    if k is None:
        raise ShardingError(
            f"shard_map on {mesh!r} in process {collectives.rank()}, which holds none of its "
            "devices: fn has no block to run on here (this process did take part in creating "
            "the mesh's process groups, which every process must). Build the mesh over every "
            "process, or skip this call where collectives.my_index(mesh) is None after that."
        )
    return k


def run_spmd(fn: Callable[..., Any], mesh: DeviceMesh,
             inputs: Sequence[tuple[Sequence[torch.Tensor | None], Layout]], timeout_s: float
             ) -> tuple[list[Any], int | None]:
    """Run ``fn`` on this process's blocks (one per input), with the lax collectives
    over torch.distributed groups; returns the per-device outputs (None for the
    other processes' devices) and this process's device index."""
    k = process_index(mesh)
    blocks = []
    for shards, layout in inputs:
        block = shards[k]
        assert block is not None
        blocks.append(replicate(block, mesh, layout.replicated_axes()))
    prev = spmd.enter(DistEnv(mesh, k))
    try:
        out = fn(*blocks)
    finally:
        spmd.enter(prev)
    outs: list[Any] = [None] * mesh.num_devices
    outs[k] = out
    return outs, k



def spmd_outputs(mesh: DeviceMesh, index: int | None,
                 blocks: Sequence[Sequence[torch.Tensor | None]], layouts: Sequence[Layout],
                 check: bool, shapes: Sequence[tuple[int, ...] | None] = ()) -> SpmdOutputs:
    """shard_map's outputs (see ``Backend.spmd_outputs``) from this process's blocks:
    one small all_gather of the block shapes (only when a dim is sharded or equality
    is checked, and the global shape is not known), one max/min all_reduce per checked
    output, and the zero-gradient boundary off coordinate 0 of the replicated axes."""
    assert index is not None, "run_spmd ran fn here, so this process holds a device"
    mine: list[torch.Tensor] = []
    for b in blocks:
        block = b[index]
        assert block is not None
        mine.append(block)
    metas: list[Any] = [None] * len(mine)
    known = [j < len(shapes) and shapes[j] is not None for j in range(len(mine))]
    for j, lay in enumerate(layouts):
        if known[j] and not check:
            metas[j] = _known(mine[j], shapes[j], lay, mesh, index)  # type: ignore[arg-type]
    needs = [j for j, lay in enumerate(layouts)
             if metas[j] is None and (check or any(lay.dims))]
    if needs:
        # One small all_gather tells every process every block's shape.
        flat = [s for j in needs for s in mine[j].shape]
        grp = collectives.group(mesh, tuple(range(mesh.ndim)))
        device = mine[needs[0]].device
        got = host_ints(lambda: collectives.all_gather(
            torch.tensor(flat, dtype=torch.int64, device=device), 0, grp,
            [len(flat)] * grp.size, "lax: output shapes"))
        rows = [got[i:i + len(flat)] for i in range(0, len(got), len(flat))]
        off = 0
        for j in needs:
            v = mine[j]
            metas[j] = [(tuple(int(x) for x in row[off:off + v.ndim]), v.dtype) for row in rows]
            off += v.ndim
    differ: list[tuple[int, ...] | None] = (_differ(mine, layouts, mesh) if check and mine
                                            else [None] * len(mine))
    shards: list[list[torch.Tensor | None]] = []
    for v, lay in zip(mine, layouts):
        out: list[torch.Tensor | None] = [None] * mesh.num_devices
        out[index] = take_first(v, mesh, index, lay.replicated_axes())
        shards.append(out)
    return metas, shards, differ


def _known(block: torch.Tensor, shape: tuple[int, ...], layout: Layout, mesh: DeviceMesh,
           index: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Every device's block shape of a value of global ``shape`` laid out as ``layout``,
    after checking this process's own block against it."""
    want = [local_shape(shape, layout, mesh.coord_of(k)) for k in range(mesh.num_devices)]
    if tuple(block.shape) != want[index]:
        raise ShardingError(
            f"shard_map: the output's global shape was given as {tuple(shape)}, which "
            f"{layout} lays out as a block of {want[index]} on {mesh.devices[index]!r}, but "
            f"fn returned {tuple(block.shape)} there. Fix out_shapes or the blocks fn returns.")
    return [(w, block.dtype) for w in want]


def _differ(mine: Sequence[torch.Tensor], layouts: Sequence[Layout], mesh: DeviceMesh
            ) -> list[tuple[int, ...] | None]:
    """Per output: ``()`` when the blocks differ along its replicated axes, else None
    (one max and one min all_reduce per output, one max over every flag)."""
    bad = []
    for v, lay in zip(mine, layouts):
        axes = lay.replicated_axes()
        if not axes:
            bad.append(0.0)
            continue
        grp = collectives.group(mesh, axes)
        x = v.detach().to(torch.float64)
        hi = collectives.all_reduce(x, grp, ReduceOp.MAX)
        lo = collectives.all_reduce(x, grp, ReduceOp.MIN)
        bad.append(0.0 if torch.allclose(hi, lo, equal_nan=True) else 1.0)
    flags = torch.tensor(bad, dtype=torch.float64, device=mine[0].device)
    flags = collectives.all_reduce(flags, collectives.group(mesh, tuple(range(mesh.ndim))),
                                   ReduceOp.MAX)
    return [() if f else None for f in flags.tolist()]
