"""The simulated runtime's fast path on host meshes (every device a virtual device of
one memory: virtual CPUs, or virtual devices on one GPU; no block ever moves between
torch devices): recipes compiled once into few torch calls. See
:mod:`shardwise.runtime.simulated` for the rules it follows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, TypeAlias

import torch

from shardwise.runtime import blocks, buffers
from shardwise.runtime.blocks import Node, recording
from shardwise.runtime.buffers import out_buffer
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh

__all__ = ["MMAP_MAX", "assemble_host", "is_host", "recording", "routes", "slice_index"]

# A compiled node: ("piece", split, i) = piece i of the split-th shared split,
# ("leaf", src_device, index | None) with ``index`` a tuple of slices (one basic-indexing
# call instead of a narrow per dim), or ("cat", dim, children, sources | None) with
# ``sources`` the source devices when every child is a whole source block.
_Prog: TypeAlias = "tuple[tuple[Any, ...], tuple[Node, ...], tuple[int, ...], int, Any]"
MMAP_MAX = 32 * 2**20  # glibc maps blocks above this fresh (page faults) in every mode


@functools.lru_cache(maxsize=256)
def is_host(mesh: DeviceMesh) -> bool:
    """True when every device of ``mesh`` is a virtual device of one memory (virtual
    CPUs, or virtual devices on one GPU: no block ever moves)."""
    return mesh.is_simulated


def slice_index(narrows: tuple[tuple[int, int, int], ...]) -> tuple[slice, ...] | None:
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
    return ("piece", *piece) if piece else ("leaf", node[1], slice_index(node[2]))


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
    rep_dst, nodes = blocks.assemble_recipe(src, dst, shape)
    splits = tuple((j, d, list(sizes)) for j, d, sizes, _ in blocks.source_splits(src, dst, shape))
    cut = {key: (s, i) for s, (*_, keys) in enumerate(blocks.source_splits(src, dst, shape))
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
    if recording(srcs):
        return None
    whole = _adjacent_view(srcs, d)
    if whole is not None:
        return list(whole.split(c, e))
    first = srcs[0]
    block = list(first.shape)
    block[e] = c
    block[d] = sum(t.shape[d] for t in srcs)
    nbytes = math.prod(block) * count * first.element_size()
    if nbytes > MMAP_MAX and not (buffers.buffer_reuse() or buffers.pool_limit()):
        return None  # fresh huge pages too: a cat per target measured faster
    out = buffers.empty((count, *block), first)
    offset = 0
    for t in srcs:
        length = t.shape[d]
        out.narrow(d + 1, offset, length).copy_(t.unflatten(e, (count, c)).movedim(e, 0))
        offset += length
    return list(out.unbind(0))


@functools.lru_cache(maxsize=4096)
def routes(src: Layout, dst: Layout, shape: tuple[int, ...]) -> tuple[_Prog, Any]:
    """The direct program, and for small tensors the (gather, cut) programs through
    the fully gathered layout (same Partial axes) when that costs fewer torch calls
    than building each target block (all_to_all: 2 calls instead of 2 per device)."""
    direct = _program(src, dst, shape)
    whole = Layout(src.mesh, ((),) * len(shape), src.partial)
    if whole in (src, dst):
        return direct, None
    gather, cut = _program(src, whole, shape), _program(whole, dst, shape)
    return direct, (gather, cut) if gather[3] + cut[3] < direct[3] else None


def _adjacent_view(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor | None:
    """``cat(parts, dim)`` as a view when the parts are adjacent views of one buffer
    (e.g. shards that were sliced from one tensor), else None."""
    first = parts[0]
    if first.numel() == 0 or recording(parts):
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
        return _cat(parts, node[1])
    return torch.cat(parts, dim=node[1])


def _cat(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    first = parts[0]
    shape = list(first.shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return torch.cat(list(parts), dim=dim, out=out_buffer(shape, first, parts))


def assemble_host(shards: Sequence[torch.Tensor], prog: _Prog, big: bool) -> list[torch.Tensor]:
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
