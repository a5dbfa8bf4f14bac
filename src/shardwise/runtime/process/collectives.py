"""The torch.distributed collectives, written once: each primitive's transport and its
agreement check, on local tensors (no autograd; :mod:`.functions` wraps them with their
transposes for the planner's steps and shard_map's lax ops alike).

Invariants:
- Each call runs one native collective (or one batch of point-to-point sends) on the
  process group of its mesh axes (:mod:`.groups`: created once per (mesh, axes)).
- Inputs are never mutated: collectives run on fresh buffers.
- Every collective first agrees on its fingerprint with its group (``agreement.py``:
  one fixed-size control message; a small float all_reduce travels inside it) and
  every wait is bounded by the run's timeout: a skipped, mismatched, stalled or dead
  peer raises :class:`CollectiveError` on the others, never a hang or a Gloo abort.
  The fingerprint holds only what every member sees alike (global sizes, not the
  local block's).
- Members are in mesh-axis order whatever torch's rank order (``Group.slot``).
- While torch.compile traces (AOTAutograd running a compiled graph's shardwise nodes),
  all_reduce, and all_gather / reduce_scatter of even blocks in torch's rank order,
  are torch's functional collectives (:func:`traced`): graph nodes, with no agreement
  message (the graph is the same program on every rank); the others raise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwise.runtime import buffers, check_reduce
from shardwise.runtime.process import agreement
from shardwise.runtime.process.groups import (  # re-exported: the runtime reaches groups here
    Group,
    group,
    is_process_mesh,
    my_index,
    prepare_stage_groups,
    process_mesh,
    rank,
    refuse_outsider,
    reset_groups,
    sizes_along,
    world_group,
)
from shardwise.runtime.process.world import WORLD
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.placements import ReduceOp

__all__ = ["Group", "agree_permute", "all_gather", "all_reduce", "all_to_all", "broadcast",
           "group", "is_process_mesh", "my_index", "permute", "prepare_stage_groups",
           "process_mesh", "rank", "reduce_scatter", "refuse_outsider", "reset_groups",
           "sizes_along", "world_group"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_TORCH_OP = agreement._TORCH_OP
_FLAT = (torch.float32, torch.float64)  # the dtypes of agreement.fold_reduce (numpy)



def _agree(what: str, g: Group, shape: tuple[int, ...], dtype: Any, tag: str,
           op: ReduceOp | None = None, sizes: tuple[int, ...] = (),
           device: torch.device | None = None, fold: int = 0) -> Callable[[], None]:
    """Send the control message of one collective (see ``agreement.py``). Returns the
    wait-and-check, which the caller runs after preparing its buffers and before any
    data moves; with the debug check on, that also all_gathers every member's full
    fingerprint."""
    if WORLD.check_collectives:
        tag += " [debug check]"  # members that differ in the mode disagree here
    fp = agreement.fingerprint(what, op, g.label, shape, dtype, tag, sizes, fold)
    pending: list[Callable[[], None]] = []
    if WORLD.agreement:
        agreement.agree(g.pg, g.ranks, g.label, fp, device=device, deferred=pending)

    def done() -> None:
        for finish in pending:
            finish()
        if WORLD.check_collectives:
            agreement.debug_check(g.pg, g.ranks, g.slot, g.label, fp)
    return done


def _call(what: str, g: Group, fn: Callable[[], Any]) -> Any:
    """Run the data exchange of an agreed collective (every one passes here once)."""
    return agreement.run(what, g.label, g.ranks, fn, g.pg or dist.group.WORLD)


#: shardwise's reduce ops as torch's functional collectives name them
_FUNCTIONAL_OP = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MIN: "min",
                  ReduceOp.MAX: "max", ReduceOp.PROD: "product"}

#: a traced all_reduce of at most this many bytes on CPU (Gloo) over 3 or more members
#: is an all_gather and a local reduction: one pass round the ring instead of two,
#: which is what small messages pay for (measured on 4 ranks: 64 KiB 2.5 against 4.4
#: ms, 256 KiB 3.2 against 4.9; at 1 MiB the ring's half the bytes wins, 5.0 against
#: 7.1; on 2 members the ring is one exchange already, and no slower)
GATHER_REDUCE_MAX = 256 * 1024
#: the reduction of the members' pieces stacked along dim 0 (in the pieces' dtype)
_LOCAL_REDUCE: dict[ReduceOp, Callable[[torch.Tensor], torch.Tensor]] = {
    ReduceOp.SUM: lambda t: t.sum(0, dtype=t.dtype), ReduceOp.AVG: lambda t: t.mean(0),
    ReduceOp.MAX: lambda t: t.amax(0), ReduceOp.MIN: lambda t: t.amin(0),
    ReduceOp.PROD: lambda t: t.prod(0, dtype=t.dtype),
}


def _gather_reduce(x: torch.Tensor, g: Group) -> bool:
    """Whether a traced all_reduce of ``x`` over ``g`` goes as all_gather + local
    reduce (every op has its local reduction in ``_LOCAL_REDUCE``)."""
    n = x.numel()
    return (g.size > 2 and x.device.type == "cpu" and isinstance(n, int)
            and 0 < n * x.element_size() <= GATHER_REDUCE_MAX)


def traced(what: str, x: torch.Tensor, g: Group, *, op: ReduceOp | None = None,
           dim: int = 0, sizes: Sequence[int] = (), dim2: int = 0,
           send: Sequence[int] = ()) -> torch.Tensor:
    """The collective ``what`` as a functional collective of torch's, for a graph being
    traced: all_reduce (``op``), all_gather and reduce_scatter along ``dim`` of the
    members' blocks of ``sizes`` (even; members in any order), and all_to_all (``x``
    split along ``dim2`` in pieces of ``send``, the pieces received, of ``sizes``,
    joined along ``dim``; even and in torch's rank order). Others raise."""
    import torch.distributed._functional_collectives as funcol

    # (pairwise, not a set: a symbolic size, from dynamic shapes, has no hash)
    same = all(n == sizes[0] for n in sizes[1:])
    even = g.slot is None and same
    # (traced, each returns its result already waited for: a wait_tensor node)
    if what == "all_reduce" and op is not None:
        if _gather_reduce(x, g):  # (every member reduces the same rows in rank order)
            rows = funcol.all_gather_tensor(x.reshape(1, -1), 0, g.pg)
            return _LOCAL_REDUCE[op](rows).view(x.shape)
        out: torch.Tensor = funcol.all_reduce(x, _FUNCTIONAL_OP[op], g.pg)
        return out
    if what == "all_gather" and same:  # (members in torch's rank order, then in theirs)
        out = funcol.all_gather_tensor(x.movedim(dim, 0).contiguous(), 0, g.pg)
        if g.slot is not None:
            m = sizes[0]
            out = torch.cat([out.narrow(0, j * m, m) for j in g.slot])
        return out.movedim(0, dim)
    if what == "reduce_scatter" and same and op is not None:
        xm = x.movedim(dim, 0)
        if g.slot is not None:  # the members' pieces in torch's rank order
            xm = torch.cat(g.by_slot(list(xm.split(sizes[0], 0))))
        out = funcol.reduce_scatter_tensor(xm.contiguous(), _FUNCTIONAL_OP[op], 0, g.pg)
        return out.movedim(0, dim)
    if what == "all_to_all" and even and all(n == send[0] for n in send[1:]):
        chunks = [c.movedim(dim, 0).reshape(-1) for c in x.split(list(send), dim2)]
        moved = list(x.movedim(dim, 0).shape)  # a received piece: as all_to_all's
        if dim2 != dim:
            moved[dim2 + 1 if dim2 < dim else dim2] = send[g.pos]
        rest = math.prod(moved[1:])
        out = funcol.all_to_all_single(torch.cat(chunks), [n * rest for n in sizes],
                                       [c.numel() for c in chunks], g.pg)
        return out.view(sum(sizes), *moved[1:]).movedim(0, dim)
    raise ShardingError(
        f"torch.compile cannot trace shardwise's {what} over {g.label or 'its group'} "
        f"yet (sizes {tuple(sizes)}, members in mesh order {g.slot}): only all_reduce, "
        "all_gather / reduce_scatter of even blocks, and all_to_all of even blocks in "
        "rank order, are functional collectives in the graph. Run this part eagerly "
        "(torch.compiler.disable) or choose a layout with even blocks.")


def _shape(shape: Sequence[int], dims: dict[int, int]) -> tuple[int, ...]:
    """``shape`` with some dims replaced: the rank-independent shape of a call."""
    return tuple(dims.get(d, s) for d, s in enumerate(shape))


# --- primitives on local tensors (no autograd) -------------------------------------------
def all_gather(x: torch.Tensor, dim: int, g: Group, sizes: Sequence[int], tag: str = ""
               ) -> torch.Tensor:
    """Concatenate the members' blocks along ``dim`` (uneven sizes padded in transit)."""
    if g.size == 1:
        return x
    if torch.compiler.is_compiling():
        return traced("all_gather", x, g, dim=dim, sizes=sizes)
    shape = _shape(x.shape, {dim: sum(sizes)})
    fold = agreement.gather_fold(x, math.prod(shape))
    if _fold_gather(x, math.prod(shape), g):  # the pieces ride in the control message
        xm = x.movedim(dim, 0).contiguous()
        rest = math.prod(xm.shape[1:])
        fp = agreement.fingerprint("all_gather", None, g.label, shape, x.dtype, f"{tag} dim {dim}",
                                   tuple(sizes), fold)
        flat = _call("all_gather", g, lambda: agreement.agree(
            g.pg, g.ranks, g.label, fp, xm, place=(sum(sizes[:g.pos]) * rest,
                                                   math.prod(shape))))
        return flat.view(sum(sizes), *xm.shape[1:]).movedim(0, dim)
    done = _agree("all_gather", g, shape, x.dtype, f"{tag} dim {dim}", sizes=tuple(sizes),
                  device=x.device, fold=fold)
    if x.device.type == "cpu":
        return _all_gather_by_exchange(x, dim, g, sizes, done)
    m = max(sizes)
    xm = x.movedim(dim, 0)
    if xm.shape[0] < m:
        xm = torch.cat([xm, xm.new_zeros((m - xm.shape[0], *xm.shape[1:]))])
    xm = xm.contiguous()
    out = buffers.empty((g.size * m, *xm.shape[1:]), xm)
    done()
    _call("all_gather", g, lambda: _all_gather(out, xm, group=g.pg))
    if g.slot is not None or any(s != m for s in sizes):
        slots = g.slot or range(g.size)
        out = torch.cat([out.narrow(0, slots[p] * m, s) for p, s in enumerate(sizes)])
    return out.movedim(0, dim)


def _all_gather_by_exchange(x: torch.Tensor, dim: int, g: Group, sizes: Sequence[int],
                            agreed: Callable[[], None]) -> torch.Tensor:
    """all_gather as point-to-point sends of this block to every peer, each received
    straight into its place in the result. Why on CPU: Gloo's all_gather measured
    slower (DESIGN's decisions log has the figures). Uneven pieces need no padding,
    and members land in member order whatever torch's rank order."""
    xm = x.movedim(dim, 0).contiguous()
    out = buffers.empty((sum(sizes), *xm.shape[1:]), xm)
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    out.narrow(0, starts[g.pos], sizes[g.pos]).copy_(xm)
    agreed()  # the control message travelled while this copied
    ops = []
    for step in range(1, g.size):  # staggered peers, so no rank is everyone's first
        to, frm = (g.pos + step) % g.size, (g.pos - step) % g.size
        if sizes[g.pos]:
            ops.append(dist.P2POp(dist.isend, xm, g.ranks[to], g.pg))
        if sizes[frm]:
            ops.append(dist.P2POp(dist.irecv, out.narrow(0, starts[frm], sizes[frm]),
                                  g.ranks[frm], g.pg))
    if ops:
        _call("all_gather", g, lambda: agreement.wait_all(dist.batch_isend_irecv(ops)))
    return out.movedim(0, dim)


def _checked(g: Group, x: torch.Tensor) -> int:
    """Room for data like ``x`` in ``g``'s next control message (0: none)."""
    if not WORLD.agreement or WORLD.check_collectives:
        return 0
    return agreement.room(g.pg, g.ranks, x)


def _fold_gather(x: torch.Tensor, total: int, g: Group) -> bool:
    """The pieces of a gather (or broadcast) ride in the control message."""
    room = _checked(g, x)
    return room > 0 and agreement.foldable_gather(x, total, room)


def _fold(x: torch.Tensor, op: ReduceOp, g: Group) -> bool:
    """A sum or mean of ``x`` rides in the control message (it is summed)."""
    room = _checked(g, x)
    return room > 0 and agreement.foldable(x, op, room)


def all_reduce(x: torch.Tensor, g: Group, op: ReduceOp, tag: str = "") -> torch.Tensor:
    check_reduce(x, op)
    if g.size == 1:
        return buffers.empty(x.shape, x).copy_(x)
    if torch.compiler.is_compiling():
        return traced("all_reduce", x, g, op=op)
    fold = agreement.reduce_fold(x, op)
    if WORLD.agreement and not WORLD.check_collectives:
        ch = agreement.channel(g.pg, g.ranks, x.device)
        k = ch.kind()
        fp = agreement.fingerprint("all_reduce", op, g.label, tuple(x.shape), x.dtype, tag, (),
                                   fold)
        if k.fused and fp.fuse == k:  # a repeated large all_reduce: the data is the message
            fused: torch.Tensor = _call("all_reduce", g, lambda: agreement.agree_fused(
                g.pg, g.ranks, g.label, fp, x))
            return fused
        if agreement.foldable(x, op, ch.room(x.dtype)):  # data in the control message
            flat = x.dtype in _FLAT and x.device.type == "cpu"
            out: torch.Tensor = _call("all_reduce", g, (
                lambda: agreement.fold_reduce(ch, g.label, fp, x, op, k)) if flat else (
                lambda: agreement.agree(g.pg, g.ranks, g.label, fp, x, op)))
            return out
    done = _agree("all_reduce", g, tuple(x.shape), x.dtype, tag, op, device=x.device,
                  fold=fold)
    out = buffers.empty(x.shape, x).copy_(x)  # a clone (huge pages when large)
    done()  # the control message travelled while this copied
    _call("all_reduce", g, lambda: dist.all_reduce(out, _TORCH_OP[op], group=g.pg))
    return out


def reduce_scatter(x: torch.Tensor, dim: int, g: Group, sizes: Sequence[int],
                   op: ReduceOp, tag: str = "") -> torch.Tensor:
    """Reduce the members' full blocks and keep this member's piece along ``dim``."""
    if g.size == 1:
        return x.clone()
    check_reduce(x, op)
    if torch.compiler.is_compiling():
        return traced("reduce_scatter", x, g, op=op, dim=dim, sizes=sizes)
    fold = agreement.reduce_fold(x, op)
    if _fold(x, op, g):  # data in the message
        fp = agreement.fingerprint("reduce_scatter", op, g.label, tuple(x.shape), x.dtype,
                                   f"{tag} dim {dim}", tuple(sizes), fold)
        full: torch.Tensor = _call("reduce_scatter", g,
                                   lambda: agreement.agree(g.pg, g.ranks, g.label, fp, x, op))
        return full.narrow(dim, sum(sizes[:g.pos]), sizes[g.pos])
    done = _agree("reduce_scatter", g, tuple(x.shape), x.dtype, f"{tag} dim {dim}", op,
                  tuple(sizes), x.device, fold)
    if x.device.type == "cpu":
        return _reduce_scatter_by_exchange(x, dim, g, sizes, op, done)
    m = max(sizes)
    xm = x.movedim(dim, 0)
    if g.slot is None and all(s == m for s in sizes):
        inp = xm.contiguous()
    else:
        parts, off = [], 0
        for s in sizes:
            piece = xm.narrow(0, off, s)
            off += s
            if s < m:
                piece = torch.cat([piece, piece.new_zeros((m - s, *piece.shape[1:]))])
            parts.append(piece)
        inp = torch.cat(g.by_slot(parts))
    out = inp.new_empty((m, *inp.shape[1:]))
    done()
    _call("reduce_scatter", g, lambda: _reduce_scatter(out, inp, _TORCH_OP[op], group=g.pg))
    return out.narrow(0, 0, sizes[g.pos]).movedim(0, dim)


def _reduce_scatter_by_exchange(x: torch.Tensor, dim: int, g: Group, sizes: Sequence[int],
                                op: ReduceOp, agreed: Callable[[], None]) -> torch.Tensor:
    """reduce_scatter as one all_to_all (member j gets everyone's piece j) and a local
    reduction. Why on CPU: Gloo's reduce_scatter is a clone, a whole-tensor ring
    all_reduce and a copy, which moves 2(n-1)/n of the tensor per rank; this moves
    (n-1)/n. No padding for uneven pieces: all_to_all takes per-peer sizes."""
    xm = x.movedim(dim, 0)
    rest = math.prod(xm.shape[1:])
    pieces = g.by_slot(list(xm.split(list(sizes), 0)))
    inp = (xm if g.slot is None else torch.cat(pieces)).contiguous()
    mine = sizes[g.pos]
    out = buffers.empty((g.size * mine * rest,), x)
    in_splits = [p.shape[0] * rest for p in pieces]
    agreed()
    _call("reduce_scatter", g, lambda: dist.all_to_all_single(
        out, inp.view(-1), [mine * rest] * g.size, in_splits, group=g.pg))
    return _LOCAL_REDUCE[op](out.view(g.size, mine, *xm.shape[1:])).movedim(0, dim)


def all_to_all(x: torch.Tensor, dim: int, dim2: int, g: Group, send: Sequence[int],
               recv: Sequence[int], tag: str = "") -> torch.Tensor:
    """Split ``x`` along ``dim2`` (``send[j]`` to member j); concatenate what
    arrives along ``dim`` (``recv[i]`` from member i).

    Each chunk is packed with ``dim`` outermost, in one copy into one buffer, so
    what arrives is already the concatenation along ``dim``: no unpack copy."""
    if g.size == 1:
        return x
    if torch.compiler.is_compiling():
        return traced("all_to_all", x, g, dim=dim, sizes=recv, dim2=dim2, send=send)
    # send/recv are this member's row and column of the exchange: not rank-independent
    done = _agree("all_to_all", g, _shape(x.shape, {dim: -1, dim2: -1}), x.dtype,
                  f"{tag} dim {dim}<-{dim2}", device=x.device)
    chunks = g.by_slot([c.movedim(dim, 0) for c in x.split(list(send), dim2)])
    in_splits = [c.numel() for c in chunks]
    flat_in = x.new_empty(sum(in_splits))
    off = 0
    for c, n in zip(chunks, in_splits):
        flat_in[off: off + n].view(c.shape).copy_(c)
        off += n
    # A received piece: ``dim`` outermost (recv[i] long), ``dim2`` is my own chunk's
    # length (``dim2`` may have shifted by the move; when dim == dim2 the received
    # length is recv[i] alone).
    moved = list(x.movedim(dim, 0).shape)
    if dim2 != dim:
        moved[dim2 + 1 if dim2 < dim else dim2] = send[g.pos]
    rest = 1
    for v in moved[1:]:
        rest *= v
    out_splits = g.by_slot([s * rest for s in recv])
    flat_out = buffers.empty((sum(out_splits),), x)
    done()  # the control message travelled while this packed
    _call("all_to_all", g, lambda: dist.all_to_all_single(
        flat_out, flat_in, out_splits, in_splits, group=g.pg))
    if g.slot is None:
        return flat_out.view(sum(recv), *moved[1:]).movedim(0, dim)
    pieces = g.by_member(list(flat_out.split(out_splits)))
    return torch.cat([p.view(r, *moved[1:]) for p, r in zip(pieces, recv)]).movedim(0, dim)


def permute(x: torch.Tensor | None, send_to: int | None, recv_from: int | None,
            like: torch.Tensor, g: Group | None = None, tag: str = "") -> torch.Tensor:
    """Send ``x`` to rank ``send_to`` and receive from ``recv_from`` (zeros if None).

    ``g``: the group of every process taking part (each calls this, also one that
    keeps its own block, so that all agree first); ``tag`` must be the same on all
    of them (e.g. the whole permutation), the block shape may differ."""
    if torch.compiler.is_compiling():
        return traced_permute(x, send_to, recv_from, like, g)
    done = agree_permute(g, like, tag) if g is not None else None
    ops = []
    # Receivers are overwritten whole; only a device that receives nothing holds zeros.
    out = (torch.zeros_like(like, memory_format=torch.contiguous_format) if recv_from is None
           else torch.empty_like(like, memory_format=torch.contiguous_format))
    if done is not None:
        done()
    if send_to is not None and x is not None:
        ops.append(dist.P2POp(dist.isend, x.contiguous(), send_to))
    if recv_from is not None:
        ops.append(dist.P2POp(dist.irecv, out, recv_from))
    if ops:
        peers = (send_to or 0, recv_from or 0)
        pair = g or Group(None, (), peers, 0, f"ranks {peers}")
        _call("ppermute", pair, lambda: agreement.wait_all(dist.batch_isend_irecv(ops)))
    return out


def traced_permute(x: torch.Tensor | None, send_to: int | None, recv_from: int | None,
                   like: torch.Tensor, g: Group | None) -> torch.Tensor:
    """:func:`permute` for a graph being traced: one all_to_all over ``g`` that every
    member calls (a member that keeps its block too: ``send_to`` and ``recv_from``
    None), sending ``x`` whole to one rank and receiving ``like``'s size from one."""
    import torch.distributed._functional_collectives as funcol

    if g is None or g.pg is None:
        raise ShardingError(
            "torch.compile cannot trace a point-to-point exchange outside a process "
            "group of the mesh. Run this part eagerly (torch.compiler.disable).")
    order = sorted(g.ranks)  # torch's order of the members
    sending = x is not None and send_to is not None
    flat = x.contiguous().view(-1) if sending else like.new_empty(0)  # type: ignore[union-attr]
    got = funcol.all_to_all_single(
        flat, [like.numel() if r == recv_from else 0 for r in order],
        [flat.numel() if r == send_to else 0 for r in order], g.pg)
    if recv_from is None:  # (+ the empty result's sum: the graph keeps the exchange)
        return torch.zeros_like(like, memory_format=torch.contiguous_format) + got.sum()
    return got.view(like.shape)


def agree_permute(g: Group, like: torch.Tensor, tag: str) -> Callable[[], None]:
    """Send the control message of a point-to-point exchange among ``g``'s members
    (rank-independent fingerprint: dtype, ndim and ``tag``); returns its wait-and-check."""
    if g.size > 1:
        return _agree("ppermute", g, (like.dim(),), like.dtype, tag, device=like.device)
    return _nothing


def _nothing() -> None:
    pass


def broadcast(x: torch.Tensor, src_rank: int, g: Group, tag: str = "") -> torch.Tensor:
    if g.size == 1:
        return x.clone(memory_format=torch.contiguous_format)
    if torch.compiler.is_compiling():
        return traced("broadcast", x, g)
    tag = f"{tag} from rank {src_rank}"
    fold = agreement.gather_fold(x, x.numel())
    if _fold_gather(x, x.numel(), g):  # the source's data rides in the control message
        fp = agreement.fingerprint("broadcast", None, g.label, tuple(x.shape), x.dtype, tag, (),
                                   fold)
        piece = x if rank() == src_rank else x.reshape(-1)[:0]
        flat = _call("broadcast", g, lambda: agreement.agree(g.pg, g.ranks, g.label, fp, piece,
                                                             place=(0, x.numel())))
        return flat.view(x.shape)
    done = _agree("broadcast", g, tuple(x.shape), x.dtype, tag, device=x.device, fold=fold)
    out = x.clone(memory_format=torch.contiguous_format)
    done()
    _call("broadcast", g, lambda: dist.broadcast(out, src_rank, group=g.pg))
    return out
