"""The simulated runtime: every device of the mesh in this process.

Invariants:
- ``shards[k]`` is device ``k``'s local ``torch.Tensor`` (row-major over the mesh).
- Devices that differ only along Replicated mesh axes hold the *same* tensor
  object (one buffer); contiguous sub-blocks are views. Nothing here mutates
  an input, which is what makes the sharing safe.
- Every step is made of differentiable torch ops (narrow, cat, add, maximum...)
  applied once per distinct object, so torch's autograd (reverse and forward
  mode) computes the exact gradient of the global computation: a replica used
  N times gets its gradient summed once, never N times too large.
- Execution recipes (which source block feeds which target block) are
  computed once per (layout, layout, shape) and cached, with the choice of
  torch calls made once too (host meshes):
  - small tensors (at most ``SMALL_BYTES``): all_to_all-like moves gather whole
    and cut views (two torch calls instead of two per device); small sums of
    more than 3 terms are one ``stack().sum()`` when no gradient is recorded;
  - large tensors: targets are built block by block into contiguous buffers;
    an all_to_all fills one buffer with one strided copy per source when that
    buffer is at most 32 MiB or buffer reuse is on (glibc maps larger fresh
    blocks with mmap, whose page faults cost more than the saving), else one
    ``cat`` per target; above 32 MiB reduce_scatter reduces each target block
    on its own.
- Targets whose source pieces are adjacent views of one buffer (and no
  gradient is being recorded) are returned as views of it: no copy (large
  tensors; the check costs more than a small copy).
- Buffer reuse is opt-in (:func:`set_buffer_reuse`): it keeps freed buffers in
  the C heap, so a fresh 64 MiB output costs a copy, not ~3 copies of page faults.
"""

from __future__ import annotations

import ctypes
import functools
import math
import operator
import platform
from collections.abc import Sequence
from typing import Any, TypeAlias

import torch
import torch.autograd.forward_ad as fwAD

from shardwise.planner import Plan, Step
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import local_bounds, local_shape, split_bounds

__all__ = [
    "assemble",
    "buffer_reuse",
    "device_of",
    "diverge",
    "execute_plan",
    "global_value",
    "make_partial",
    "owned",
    "permute",
    "reduce",
    "reduce_scatter",
    "relabel",
    "rep_indices",
    "run_step",
    "set_buffer_reuse",
]

Shards: TypeAlias = "list[torch.Tensor]"
# A recipe node: ("leaf", src_device, ((dim, start, length), ...), move_to | None)
#             or ("cat", dim, (child, child, ...)).
Node: TypeAlias = "tuple[Any, ...]"


@functools.lru_cache(maxsize=4096)
def rep_indices(layout: Layout) -> tuple[int, ...]:
    """For each device, the device whose object it shares: its coordinate with
    every replicated mesh axis set to 0."""
    mesh = layout.mesh
    used = set(layout.sharded_axes) | set(layout.partial_axes)
    out = []
    for k in range(mesh.num_devices):
        coord = [c if a in used else 0 for a, c in enumerate(mesh.coord_of(k))]
        out.append(mesh.index_of(coord))
    return tuple(out)


def _piece_of(size: int, pieces: int, x: int) -> int:
    base, rem = divmod(size, pieces)
    edge = rem * (base + 1)
    return x // (base + 1) if x < edge else rem + (x - edge) // base


def _unravel(index: int, sizes: Sequence[int]) -> list[int]:
    out = []
    for s in reversed(sizes):
        index, r = divmod(index, s)
        out.append(r)
    return out[::-1]


@functools.lru_cache(maxsize=4096)
def _assemble_recipe(src: Layout, dst: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, ...],
                                                                              dict[int, Node]]:
    mesh = src.mesh
    rep_src, rep_dst = rep_indices(src), rep_indices(dst)
    # Virtual CPUs share host memory: blocks never move between torch devices.
    torch_dev = [None] * mesh.num_devices if mesh.is_simulated else [
        d.to_torch() for d in mesh.devices]
    nodes: dict[int, Node] = {}
    for k in sorted(set(rep_dst)):
        coord = mesh.coord_of(k)
        want = local_bounds(shape, dst, coord)
        per_dim: list[list[tuple[int, int, int, int]]] = []  # (piece, start, length, piece_len)
        for d, (lo, hi) in enumerate(want):
            axes = src.dims[d]
            pieces = math.prod(mesh.mesh_shape[a] for a in axes)
            size = shape[d]
            if pieces == 1:
                per_dim.append([(0, lo, hi - lo, size)])
                continue
            if hi == lo:
                # An empty block: narrow any source piece to length 0 (piece_len is that
                # piece's real length, so the narrow is not skipped).
                p = _piece_of(size, pieces, min(lo, size - 1)) if size else 0
                plo, phi = split_bounds(size, pieces, p)
                per_dim.append([(p, 0, 0, phi - plo)])
                continue
            entries = []
            for p in range(_piece_of(size, pieces, lo), _piece_of(size, pieces, hi - 1) + 1):
                plo, phi = split_bounds(size, pieces, p)
                s, e = max(lo, plo), min(hi, phi)
                entries.append((p, s - plo, e - s, phi - plo))
            per_dim.append(entries)

        def build(d: int, chosen: tuple[tuple[int, int, int, int], ...], k: int = k,
                  coord: tuple[int, ...] = coord,
                  per_dim: list[list[tuple[int, int, int, int]]] = per_dim) -> Node:
            if d == len(per_dim):
                src_coord = list(coord)
                narrows = []
                for dd, (p, start, length, plen) in enumerate(chosen):
                    axes = src.dims[dd]
                    for a, c in zip(axes, _unravel(p, [mesh.mesh_shape[a] for a in axes])):
                        src_coord[a] = c
                    if start != 0 or length != plen:
                        narrows.append((dd, start, length))
                j = rep_src[mesh.index_of(src_coord)]
                move = torch_dev[k] if torch_dev[j] != torch_dev[k] else None
                return ("leaf", j, tuple(narrows), move)
            if len(per_dim[d]) == 1:
                return build(d + 1, (*chosen, per_dim[d][0]))
            return ("cat", d, tuple(build(d + 1, (*chosen, e)) for e in per_dim[d]))

        nodes[k] = build(0, ())
    return rep_dst, nodes


@functools.lru_cache(maxsize=4096)
def _splits(src: Layout, dst: Layout, shape: tuple[int, ...]) -> tuple[
        tuple[int, int, tuple[int, ...], tuple[tuple[int, tuple[tuple[int, int, int], ...]],
                                              ...]], ...]:
    """Sources cut into several pieces along one dim that tile it exactly: one
    ``torch.split`` per source instead of one ``narrow`` per piece (all_to_all
    cuts every source into one piece per peer)."""
    _, nodes = _assemble_recipe(src, dst, shape)
    leaves: dict[int, set[tuple[tuple[int, int, int], ...]]] = {}

    def walk(node: Node) -> None:
        if node[0] == "leaf":
            leaves.setdefault(node[1], set()).add(node[2])
        else:
            for child in node[2]:
                walk(child)

    for node in nodes.values():
        walk(node)
    out = []
    mesh = src.mesh
    for j, cuts in leaves.items():
        if len(cuts) < 2 or any(len(c) != 1 for c in cuts):
            continue
        dims = {c[0][0] for c in cuts}
        if len(dims) != 1:
            continue
        d = dims.pop()
        ordered = sorted(cuts, key=lambda c: c[0][1])
        size = local_shape(shape, src, mesh.coord_of(j))[d]
        pos = 0
        for c in ordered:
            if c[0][1] != pos:
                break
            pos += c[0][2]
        else:
            if pos == size:
                out.append((j, d, tuple(c[0][2] for c in ordered),
                            tuple((j, c) for c in ordered)))
    return tuple(out)


def _run(node: Node, shards: Sequence[torch.Tensor],
         pieces: dict[tuple[int, tuple[tuple[int, int, int], ...]], torch.Tensor] | None = None
         ) -> torch.Tensor:
    if node[0] == "leaf":
        t = pieces.get((node[1], node[2])) if pieces else None
        if t is None:
            t = shards[node[1]]
            for dim, start, length in node[2]:
                t = t.narrow(dim, start, length)
        return t if node[3] is None else t.to(node[3])
    return torch.cat([_run(child, shards, pieces) for child in node[2]], dim=node[1])


# --- the host fast path ------------------------------------------------------------------
SMALL_BYTES = 1 << 18
"""Tensors of at most this many bytes (per Partial group) take the few-calls path:
there a torch call (~1-3 us) costs more than copying the data."""

# A compiled node: ("piece", split, i) = piece i of the split-th shared split,
# ("leaf", src_device, index | None) with ``index`` a tuple of slices (one basic-indexing
# call instead of a narrow per dim), or ("cat", dim, children, sources | None) with
# ``sources`` the source devices when every child is a whole source block.
_Prog: TypeAlias = "tuple[tuple[Any, ...], tuple[Node, ...], tuple[int, ...], int, Any]"
_MMAP_MAX = 32 * 2**20  # glibc maps blocks above this fresh (page faults) in every mode


@functools.lru_cache(maxsize=256)
def _host(mesh: DeviceMesh) -> bool:
    """True when every device of ``mesh`` is a virtual CPU (no block ever moves)."""
    return mesh.is_simulated


def _index(narrows: tuple[tuple[int, int, int], ...]) -> tuple[slice, ...] | None:
    if not narrows:
        return None
    index = [slice(None)] * (max(d for d, _, _ in narrows) + 1)
    for d, start, length in narrows:
        index[d] = slice(start, start + length)
    return tuple(index)


def _compile(node: Node, cut: dict[tuple[int, Any], tuple[int, int]]) -> Node:
    if node[0] == "cat":
        children = tuple(_compile(c, cut) for c in node[2])
        if all(c[0] == "leaf" and c[2] is None for c in children):  # whole source blocks
            return ("cat", node[1], children, tuple(c[1] for c in children))
        return ("cat", node[1], children, None)
    piece = cut.get((node[1], node[2]))
    return ("piece", *piece) if piece else ("leaf", node[1], _index(node[2]))


def _calls(node: Node) -> int:
    """Torch calls a compiled node costs."""
    if node[0] == "cat":
        return 1 + sum(_calls(c) for c in node[2])
    return int(node[0] == "leaf" and node[2] is not None)


@functools.lru_cache(maxsize=4096)
def _program(src: Layout, dst: Layout, shape: tuple[int, ...]) -> _Prog:
    """The direct block-by-block route (host meshes): the shared splits, one compiled
    node per distinct target block, each device's position among them, torch calls.
    When every target block is a piece of one split: no nodes, and each device's
    position in that split."""
    rep_dst, nodes = _assemble_recipe(src, dst, shape)
    splits = tuple((j, d, list(sizes)) for j, d, sizes, _ in _splits(src, dst, shape))
    cut = {key: (s, i) for s, (*_, keys) in enumerate(_splits(src, dst, shape))
           for i, key in enumerate(keys)}
    order = {k: i for i, k in enumerate(nodes)}
    compiled = tuple(_compile(n, cut) for n in nodes.values())
    calls = len(splits) + sum(_calls(n) for n in compiled)
    where = tuple(order[r] for r in rep_dst)
    if len(splits) == 1 and all(n[0] == "piece" for n in compiled):
        return splits, (), tuple(compiled[i][2] for i in where), calls, None
    return splits, compiled, where, calls, _transposition(splits, compiled)


def _transposition(splits: tuple[Any, ...], nodes: tuple[Node, ...]) -> Any:
    """``(d, e, T, c, sources)`` when the targets are an all_to_all of the sources:
    ``T`` target blocks, each the cat along ``d`` of one piece of every source, source
    ``sources[p]`` cut along ``e`` into ``T`` equal pieces of ``c`` (piece ``t`` to
    target ``t``). Then one strided copy per source fills all targets at once."""
    if not nodes or any(n[0] != "cat" or n[1] != nodes[0][1] for n in nodes):
        return None
    d, count = nodes[0][1], len(nodes)
    first = nodes[0][2]
    sources = []
    for p, child in enumerate(first):
        if child[0] != "piece":
            return None
        j, e, sizes = splits[child[1]]
        if e == d or len(sizes) != count or len(set(sizes)) != 1:
            return None
        for t, n in enumerate(nodes):
            c = n[2][p] if len(n[2]) == len(first) else None
            if c is None or c[0] != "piece" or c[1] != child[1] or c[2] != t:
                return None
        sources.append((j, e))
    if len({e for _, e in sources}) != 1:
        return None
    return d, sources[0][1], count, splits[first[0][1]][2][0], tuple(j for j, _ in sources)


def _transpose(shards: Sequence[torch.Tensor], plan: Any) -> list[torch.Tensor] | None:
    """The targets of an all_to_all (see :func:`_transposition`): views when the sources
    are adjacent views of one buffer, else one buffer filled by one strided copy per
    source (fewer, longer copies than a cat per target); None while autograd records,
    or when the buffer would be a fresh mmap (page faults cost more than the saving)."""
    d, e, count, c, sources = plan
    srcs = [shards[j] for j in sources]
    if _recording(srcs):
        return None
    whole = _adjacent_view(srcs, d)
    if whole is not None:
        return list(whole.split(c, e))
    first = srcs[0]
    block = list(first.shape)
    block[e] = c
    block[d] = sum(t.shape[d] for t in srcs)
    nbytes = math.prod(block) * count * first.element_size()
    if nbytes > _MMAP_MAX and not _buffer_reuse:
        return None
    out = first.new_empty((count, *block))
    offset = 0
    for t in srcs:
        length = t.shape[d]
        out.narrow(d + 1, offset, length).copy_(t.unflatten(e, (count, c)).movedim(e, 0))
        offset += length
    return list(out.unbind(0))


@functools.lru_cache(maxsize=4096)
def _routes(src: Layout, dst: Layout, shape: tuple[int, ...]) -> tuple[_Prog, Any]:
    """The direct program, and for small tensors the (gather, cut) programs through
    the fully gathered layout (same Partial axes) when that costs fewer torch calls
    than building each target block (all_to_all: 2 calls instead of 2 per device)."""
    direct = _program(src, dst, shape)
    whole = Layout(src.mesh, ((),) * len(shape), src.partial)
    if whole in (src, dst):
        return direct, None
    gather, cut = _program(src, whole, shape), _program(whole, dst, shape)
    return direct, (gather, cut) if gather[3] + cut[3] < direct[3] else None


_requires_grad = operator.attrgetter("requires_grad")


def _recording(parts: Sequence[torch.Tensor]) -> bool:
    """True when autograd (reverse or forward mode) may need ``parts`` as separate inputs."""
    return fwAD._current_level >= 0 or (
        torch.is_grad_enabled() and any(map(_requires_grad, parts)))


def _adjacent_view(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor | None:
    """``cat(parts, dim)`` as a view when the parts are adjacent views of one buffer
    (e.g. shards that were sliced from one tensor), else None."""
    first = parts[0]
    if first.numel() == 0 or _recording(parts):
        return None
    ptr = first.untyped_storage().data_ptr()
    stride, dtype, size = first.stride(), first.dtype, list(first.shape)
    step = stride[dim]
    end = first.storage_offset() + size[dim] * step
    for p in parts[1:]:
        if (p.untyped_storage().data_ptr() != ptr or p.stride() != stride or p.dtype != dtype
                or p.storage_offset() != end or p.numel() == 0):
            return None
        psize = p.shape
        for d in range(len(size)):
            if d != dim and psize[d] != size[d]:
                return None
        end += psize[dim] * step
        size[dim] += psize[dim]
    return first.as_strided(size, stride, first.storage_offset())


def _exec(node: Node, shards: Sequence[torch.Tensor], cuts: list[Any], big: bool
          ) -> torch.Tensor:
    kind = node[0]
    if kind == "piece":
        return cuts[node[1]][node[2]]
    if kind == "leaf":
        t = shards[node[1]]
        return t if node[2] is None else t[node[2]]
    whole = node[3]
    parts = ([shards[j] for j in whole] if whole is not None
             else [_exec(c, shards, cuts, big) for c in node[2]])
    if big:
        view = _adjacent_view(parts, node[1])
        if view is not None:
            return view
    return torch.cat(parts, dim=node[1])


def _assemble_host(shards: Sequence[torch.Tensor], prog: _Prog, big: bool) -> Shards:
    splits, nodes, where, _, transposition = prog
    if len(splits) == 1 and not nodes:  # every target block is a piece of one split
        cut = shards[splits[0][0]].split_with_sizes(splits[0][2], splits[0][1])
        return [cut[i] for i in where]
    if big and transposition is not None:
        blocks = _transpose(shards, transposition)
        if blocks is not None:
            return [blocks[i] for i in where]
    cuts = [shards[j].split_with_sizes(sizes, d) for j, d, sizes in splits]
    built = [_exec(node, shards, cuts, big) for node in nodes]
    return [built[i] for i in where]


def _nbytes(shards: Sequence[torch.Tensor], shape: tuple[int, ...]) -> int:
    return math.prod(shape) * shards[0].element_size()


def assemble(shards: Sequence[torch.Tensor], src: Layout, dst: Layout,
             shape: tuple[int, ...]) -> Shards:
    """Move blocks from layout ``src`` to ``dst`` (same Partial axes): views where a
    target block lies in one source block, one ``cat`` copy otherwise (small
    tensors: one gather and views of it; see the module doc)."""
    if not _host(src.mesh):
        rep_dst, nodes = _assemble_recipe(src, dst, shape)
        pieces: dict[tuple[int, tuple[tuple[int, int, int], ...]], torch.Tensor] = {}
        for j, d, sizes, keys in _splits(src, dst, shape):
            pieces.update(zip(keys, shards[j].split_with_sizes(list(sizes), d)))
        built = {k: _run(node, shards, pieces) for k, node in nodes.items()}
        return [built[r] for r in rep_dst]
    direct, via = _routes(src, dst, shape)
    big = _nbytes(shards, shape) > SMALL_BYTES
    if via is not None and not big:
        return _assemble_host(_assemble_host(shards, via[0], False), via[1], False)
    return _assemble_host(shards, direct, big)


def _combine(objs: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Reduce ``objs`` left to right into ONE fresh buffer: the first op allocates,
    the rest accumulate in place (a fresh 64 MiB buffer costs ~3 copies in page
    faults). In-place accumulation is autograd-safe for sum; max/min/prod keep
    out-of-place ops while a gradient is being recorded. Small floating SUM/AVG of
    more than 3 values with no gradient recorded: one ``stack(...).sum(0)`` (torch's
    reduction order and accumulation, e.g. float accumulation for half types; equal
    within rounding)."""
    first = objs[0]
    if len(objs) == 1:
        return first
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        floating = first.is_floating_point() or first.is_complex()
        if op is ReduceOp.AVG and not floating:
            raise ShardingError(
                f"Cannot average (ReduceOp.AVG) values of integer dtype {first.dtype}: the "
                "mean is not an integer. Cast to a floating dtype first, or use SUM."
            )
        if (floating and len(objs) > 3 and first.nbytes * len(objs) <= SMALL_BYTES
                and not _recording(objs)):
            # Small: 2 torch calls instead of len(objs) - 1 (call overhead dominates). Not
            # while recording: the input gradients would be views of one expanded buffer,
            # which torch's AccumulateGrad keeps as .grad and later accumulates in place.
            out = torch.stack(list(objs)).sum(0)
            return out.div_(len(objs)) if op is ReduceOp.AVG else out
        out = objs[0] + objs[1]
        for o in objs[2:]:
            out.add_(o)
        if op is ReduceOp.AVG:
            out.div_(len(objs))
        return out
    fn = {ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum, ReduceOp.PROD: torch.mul}[op]
    out = fn(objs[0], objs[1])
    tracked = (torch.is_grad_enabled() and any(o.requires_grad for o in objs)) or (
        fwAD._current_level >= 0)  # forward-mode AD has no out= variants
    for o in objs[2:]:
        out = fn(out, o) if tracked else fn(out, o, out=out)
    return out


@functools.lru_cache(maxsize=4096)
def _groups(layout: Layout, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in layout.mesh.groups(axes))


@functools.lru_cache(maxsize=4096)
def _whole(layout: Layout, axes: tuple[int, ...]) -> bool:
    """True when ``axes`` group every device of the mesh, in mesh order (one result)."""
    groups = _groups(layout, axes)
    return len(groups) == 1 and groups[0] == tuple(range(layout.mesh.num_devices))


def reduce(shards: Sequence[torch.Tensor], layout: Layout, axes: tuple[int, ...],
           op: ReduceOp) -> Shards:
    """Combine the local values along ``axes`` by ``op``; every device of a group
    gets the one result object."""
    host = _host(layout.mesh)
    if host and _whole(layout, axes):
        return [_combine(shards, op)] * len(shards)
    out: list[torch.Tensor | None] = [None] * len(shards)
    memo: dict[tuple[int, ...], torch.Tensor] = {}
    for group in _groups(layout, axes):
        objs = [shards[k] for k in group]
        key = tuple(map(id, objs))
        res = memo.get(key)
        if res is None:
            if not host:
                dev = objs[0].device
                objs = [o if o.device == dev else o.to(dev) for o in objs]
            res = memo[key] = _combine(objs, op)
        for k in group:
            out[k] = res if host or res.device == shards[k].device else res.to(
                shards[k].device)
    return out  # type: ignore[return-value]


@functools.lru_cache(maxsize=4096)
def _unreduced(layout: Layout, axes: tuple[int, ...]) -> Layout:
    """``layout`` with the Partial mesh axes ``axes`` resolved (Replicated)."""
    partial = list(layout.partial)
    for a in axes:
        partial[a] = None
    return layout.with_partial(tuple(partial))


@functools.lru_cache(maxsize=4096)
def _scatter_blocks(before: Layout, after: Layout, axes: tuple[int, ...],
                    shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[Any, ...]] | None:
    """reduce_scatter block by block: per distinct target block, the devices whose
    local values it reduces and the slice of them it takes; None when a target
    block is not one slice of the reduced value (uneven pieces that do not nest)."""
    rep_dst, nodes = _assemble_recipe(_unreduced(before, axes), after, shape)
    group_of = {k: g for g in _groups(before, axes) for k in g}
    blocks = []
    for k, node in nodes.items():
        if node[0] != "leaf":
            return None
        blocks.append((k, group_of[node[1]], node[2], _index(node[2])))
    return rep_dst, tuple(blocks)


def reduce_scatter(shards: Sequence[torch.Tensor], before: Layout, after: Layout,
                   axes: tuple[int, ...], op: ReduceOp, shape: tuple[int, ...]) -> Shards:
    """Combine the local values along ``axes`` by ``op`` and scatter the result as
    ``after`` lays it out. On the host, results above glibc's mmap limit (32 MiB)
    reduce each target block on its own: a contiguous buffer of 1/n of the bytes,
    which the C heap reuses instead of page-faulting a fresh mmap, and whose
    accumulation stays in cache longer (measured 1.06-1.6x faster at 64 MiB; at 4 MiB
    the n*(n-1) smaller calls were 1.2x slower). Otherwise reduce whole and slice."""
    plan = None
    host = _host(before.mesh)
    if host and _nbytes(shards, shape) > _MMAP_MAX:
        plan = _scatter_blocks(before, after, axes, shape)
    if plan is None:
        mid = _unreduced(before, axes)
        if host and _whole(before, axes):  # one result: cut it (small: views of it)
            return assemble([_combine(shards, op)] * len(shards), mid, after, shape)
        reduced = reduce(shards, before, axes, op)
        return assemble(_dedupe(reduced, mid), mid, after, shape)
    rep_dst, blocks = plan
    built: dict[int, torch.Tensor] = {}
    memo: dict[Any, torch.Tensor] = {}
    for k, members, key, index in blocks:
        objs = [shards[m] for m in members]
        ident = (tuple(map(id, objs)), key)
        res = memo.get(ident)
        if res is None:
            if index is not None:
                objs = [o[index] for o in objs]
            res = memo[ident] = _combine(objs, op)
        built[k] = res
    return [built[r] for r in rep_dst]


def identity_like(t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """The identity element of ``op`` broadcast to ``t``'s shape (no memory)."""
    value = 1 if op is ReduceOp.PROD else 0
    return torch.full((), value, dtype=t.dtype, device=t.device).expand(t.shape)


@functools.lru_cache(maxsize=4096)
def _roots(layout: Layout, axes: tuple[int, ...]) -> tuple[bool, ...]:
    """Per device: True when its coordinate is 0 along every one of ``axes``."""
    mesh = layout.mesh
    return tuple(all(mesh.coord_of(k)[a] == 0 for a in axes) for k in range(mesh.num_devices))


def make_partial(shards: Sequence[torch.Tensor], layout: Layout, axes: tuple[int, ...],
                 op: ReduceOp) -> Shards:
    """Replicated along ``axes`` -> Partial(op) with the same global value: for SUM
    and PROD only coordinate 0 keeps the value (others hold the identity); for
    AVG, MIN and MAX every device keeps it."""
    if op in (ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX):
        return list(shards)
    memo: dict[int, torch.Tensor] = {}
    out = []
    for t, root in zip(shards, _roots(layout, axes)):
        if root:
            out.append(t)
        else:
            ident = memo.get(id(t))
            if ident is None:
                ident = memo[id(t)] = identity_like(t, op)
            out.append(ident)
    return out


def run_step(step: Step, shards: Sequence[torch.Tensor], shape: tuple[int, ...]) -> Shards:
    """Execute one planner step on the simulated mesh."""
    kind = step.kind
    if kind in ("slice", "all_gather", "all_to_all"):
        return assemble(shards, step.before, step.after, shape)
    if kind == "all_reduce":
        assert step.reduce_op is not None
        return reduce(shards, step.before, step.axes, step.reduce_op)
    if kind == "reduce_scatter":
        assert step.reduce_op is not None
        return reduce_scatter(shards, step.before, step.after, step.axes, step.reduce_op, shape)
    if kind == "make_partial":
        assert step.reduce_op is not None
        return make_partial(shards, step.before, step.axes, step.reduce_op)
    raise AssertionError(f"unknown step kind {kind!r}")


def _dedupe(shards: Sequence[torch.Tensor], layout: Layout) -> Shards:
    reps = rep_indices(layout)
    return [shards[r] for r in reps]


def execute_plan(plan: Plan, shards: Sequence[torch.Tensor]) -> Shards:
    out = list(shards)
    for step in plan.steps:
        out = run_step(step, out, plan.shape)
    return out


def global_value(shards: Sequence[torch.Tensor], layout: Layout, shape: tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor:
    """The global value of a fully replicated tensor."""
    return shards[0]


def relabel(shards: Sequence[torch.Tensor], layout: Layout, axes: tuple[int, ...],
            op: ReduceOp) -> Shards:
    """Replicated ``axes`` become Partial(op) holding the same local values. Nothing
    to do here: replicas already share one buffer, so torch sums its gradient."""
    return list(shards)


def diverge(shards: Sequence[torch.Tensor], layout: Layout, axes: tuple[int, ...]) -> Shards:
    """A value replicated over ``axes`` feeds an op whose output is not (sharded or
    Partial there). Nothing to do here: the replicas share one buffer, so torch
    already sums the devices' shares of its gradient."""
    return list(shards)


@functools.lru_cache(maxsize=4096)
def _local_shapes(layout: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    mesh = layout.mesh
    return tuple(local_shape(shape, layout, mesh.coord_of(k)) for k in range(mesh.num_devices))


def permute(shards: Sequence[torch.Tensor], layout: Layout, source: Sequence[int | None],
            shape: tuple[int, ...]) -> Shards:
    """Device ``k`` receives device ``source[k]``'s block (zeros when None); replicas
    keep sharing one object. On the host this only relabels objects (no copy)."""
    mesh = layout.mesh
    host = _host(mesh)
    reps = rep_indices(layout)
    out: list[torch.Tensor] = []
    zeros: dict[tuple[int, ...], torch.Tensor] = {}
    for k, s in enumerate(source):
        if reps[k] != k:
            out.append(out[reps[k]])
            continue
        if s is None:
            dev = shards[0].device if host else device_of(mesh, k)
            want = _local_shapes(layout, shape)[k]
            z = zeros.get(want)
            if z is None:
                z = zeros[want] = torch.zeros((), dtype=shards[0].dtype, device=dev).expand(want)
            out.append(z)
        elif host:
            out.append(shards[s])
        else:
            got, dev = shards[s], device_of(mesh, k)
            out.append(got if got.device == dev else got.to(dev))
    return out


# --- opt-in buffer reuse ------------------------------------------------------------------
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters (malloc.h)
_GLIBC_MMAP_MAX, _GLIBC_TRIM_THRESHOLD = 65536, 128 * 1024  # glibc's defaults
_buffer_reuse = False


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)  # this process's symbols: glibc's malloc is among them
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


def set_buffer_reuse(enabled: bool = True) -> bool:
    """Opt in (or out) of reusing freed host buffers for new results; returns
    whether the setting took effect (glibc on Linux only; elsewhere a no-op).

    Why: glibc serves blocks above its mmap threshold (at most 32 MiB) with fresh
    ``mmap`` pages and unmaps them on free, so every fresh 64 MiB result page-faults
    all its pages again: on a 2-core host that costs ~3 copies of the bytes.
    Enabled, glibc serves every block from its heap (``M_MMAP_MAX = 0``) and keeps
    freed memory (``M_TRIM_THRESHOLD`` = 2 GiB), so a new result reuses the pages of
    one that died. Safe by construction: malloc never hands out memory a live
    tensor holds. Costs: process-wide; the resident size stays at its high-water
    mark (freed memory is kept for reuse, not returned to the OS).

    Disabling restores glibc's defaults for both parameters and trims the heap;
    glibc's *dynamic* mmap threshold stays off for the rest of the process. (The
    ``MALLOC_MMAP_MAX_``/``MALLOC_TRIM_THRESHOLD_`` environment variables are not
    equivalent: set before start-up, they left 64 MiB results page-faulting here.)
    """
    global _buffer_reuse
    libc = _libc()
    if libc is None:
        return False
    if enabled:
        ok = libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    else:
        ok = (libc.mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX)
              and libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_TRIM_THRESHOLD))
        libc.malloc_trim(0)
    _buffer_reuse = bool(ok) and enabled
    return bool(ok)


def buffer_reuse() -> bool:
    """Whether :func:`set_buffer_reuse` is on."""
    return _buffer_reuse


def device_of(mesh: DeviceMesh, k: int) -> torch.device:
    return mesh.devices[k].to_torch()


def owned(mesh: DeviceMesh) -> range:
    """The mesh devices this process holds: all of them."""
    return range(mesh.num_devices)
