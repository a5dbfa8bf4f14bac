"""Block recipes of the simulated runtime: which source block feeds each target
block when a tensor moves from one layout to another (pure layout arithmetic,
cached per (layout, layout, shape)), and the generic way to run one.

A recipe node is ``("leaf", src_device, ((dim, start, length), ...), move_to | None)``
(a narrowed source block, moved to another torch device if needed) or
``("cat", dim, (child, ...))``. Replicas share one node: recipes are built for
the representative device of each distinct target block (:func:`rep_indices`).

:func:`tiling_view` is the inverse question: when the blocks already tile one buffer
exactly as the layout places them, the global value is a view of that buffer (no
copy); the simulated runtime's results and users' chunks often do.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from typing import Any, TypeAlias

import torch
import torch.autograd.forward_ad as fwAD

from shardwise.sharding.layout import Layout
from shardwise.sharding.shapes import local_bounds, local_shape, split_bounds

__all__ = ["Node", "assemble_recipe", "recording", "rep_indices", "run_node",
           "source_splits", "tiling_view"]

Node: TypeAlias = "tuple[Any, ...]"

_requires_grad = operator.attrgetter("requires_grad")


def recording(parts: Sequence[torch.Tensor]) -> bool:
    """True when autograd (reverse or forward mode) may need ``parts`` as separate inputs
    (so they must not be replaced by a view of one buffer or written through ``out=``).

    >>> recording([torch.ones(2)]), recording([torch.ones(2, requires_grad=True)])
    (False, True)
    """
    return fwAD._current_level >= 0 or (
        torch.is_grad_enabled() and any(map(_requires_grad, parts)))


def rep_indices(layout: Layout) -> tuple[int, ...]:
    """For each device, the device whose object it shares (:meth:`Layout.representatives`)."""
    return layout.representatives()


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
def assemble_recipe(src: Layout, dst: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, ...],
                                                                              dict[int, Node]]:
    mesh = src.mesh
    rep_src, rep_dst = rep_indices(src), rep_indices(dst)
    # Virtual devices of one memory (host, or one GPU): blocks never move between
    # torch devices.
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
def source_splits(src: Layout, dst: Layout, shape: tuple[int, ...]) -> tuple[
        tuple[int, int, tuple[int, ...], tuple[tuple[int, tuple[tuple[int, int, int], ...]],
                                              ...]], ...]:
    """Sources cut into several pieces along one dim that tile it exactly: one
    ``torch.split`` per source instead of one ``narrow`` per piece (all_to_all
    cuts every source into one piece per peer)."""
    _, nodes = assemble_recipe(src, dst, shape)
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


def run_node(node: Node, shards: Sequence[torch.Tensor],
         pieces: dict[tuple[int, tuple[tuple[int, int, int], ...]], torch.Tensor] | None = None
         ) -> torch.Tensor:
    if node[0] == "leaf":
        t = pieces.get((node[1], node[2])) if pieces else None
        if t is None:
            t = shards[node[1]]
            for dim, start, length in node[2]:
                t = t.narrow(dim, start, length)
        return t if node[3] is None else t.to(node[3])
    return torch.cat([run_node(child, shards, pieces) for child in node[2]], dim=node[1])


@functools.lru_cache(maxsize=4096)
def _starts(layout: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, tuple[int, ...],
                                                                    tuple[int, ...]], ...]:
    """Per distinct block (its representative device): the device, the block's start
    and its shape in the global value."""
    mesh = layout.mesh
    out = []
    for k in sorted(set(layout.representatives())):
        bounds = local_bounds(shape, layout, mesh.coord_of(k))
        out.append((k, tuple(lo for lo, _ in bounds), tuple(hi - lo for lo, hi in bounds)))
    return tuple(out)


def tiling_view(shards: Sequence[torch.Tensor | None], layout: Layout,
                shape: tuple[int, ...]) -> torch.Tensor | None:
    """The global value as one view of the buffer the blocks of ``shards`` are views
    of, when they tile it exactly as ``layout`` places them (each distinct block at
    its global offset, all with one stride); else None. ``layout`` has no Partial
    axes. Empty blocks are skipped; a value with no element has no view.

    Not differentiable through the blocks: the view is of their storage, so autograd
    would reach their base without passing through them (callers check).

    >>> g = torch.arange(12.).reshape(4, 3)
    >>> lay = Layout(DeviceMesh.cpu(2, "x"), ((0,), ()), (None,))
    >>> w = tiling_view(list(g.chunk(2)), lay, (4, 3))
    >>> w.data_ptr() == g.data_ptr() and torch.equal(w, g)
    True
    >>> tiling_view([g[:2].clone(), g[2:]], lay, (4, 3)) is None
    True
    """
    if not math.prod(shape):
        return None
    base: torch.Tensor | None = None
    ptr = offset = 0
    stride: tuple[int, ...] = ()
    # (storage offsets and strides of CPU tensors are ints: no symbolic sizes here)
    for k, start, size in _starts(layout, shape):
        t = shards[k]
        if t is None or tuple(t.shape) != size:
            return None
        if not t.numel():
            continue
        if base is None:
            try:
                ptr = t.untyped_storage().data_ptr()
            except RuntimeError:  # fake or functional blocks (torch.compile): no address
                return None
            base, stride = t, t.stride()
            offset = int(t.storage_offset()) - sum(a * b for a, b in zip(start, stride))
            if offset < 0:
                return None
        elif (t.stride() != stride or t.dtype != base.dtype
              or t.untyped_storage().data_ptr() != ptr
              or t.storage_offset() != offset + sum(a * b for a, b in zip(start, stride))):
            return None
    assert base is not None  # some block holds an element of a non-empty value
    try:
        return base.as_strided(shape, stride, offset)
    except RuntimeError:  # the blocks' stride reaches past their storage for the whole
        return None
