"""A Tensor's blocks as chunks of its global value: torch.distributed.checkpoint's protocol.

``torch.distributed.checkpoint`` (DCP) asks a tensor subclass for its pieces through
three methods, which :class:`shardwise.Tensor` answers from here:
``__create_write_items__`` (save: one write item per chunk this process writes),
``__create_chunk_list__`` (load: the chunks this process fills) and
``__get_tensor_shard__`` (the local torch tensor of one chunk).

Invariants:
- A chunk is one device's block with its global offsets (the split rule of
  :mod:`shardwise.sharding.shapes`, uneven and empty blocks included); DCP reshards
  between any two sets of chunks by their offsets, so a checkpoint saved on one mesh
  and layout loads into any other.
- Save: each process lists only the blocks it holds, one item per distinct offset
  (replicas inside this process once); DCP's planner keeps one copy of an offset that
  several processes list, so every replica is written once. Empty blocks are skipped
  (a globally empty tensor still gets one chunk, so its key exists).
- Load: one chunk per distinct local buffer (replicas with separate buffers are each
  filled; buffers that replicas share are filled once), written in place: the target's
  own blocks receive the values, nothing is swapped in.
- Partial tensors are refused both ways (when planning a save, when filling a
  block on load): their blocks are addends, not pieces of the global value.
- Nothing here pickles a Tensor: DCP writes the local torch blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.shapes import local_bounds

__all__ = ["Chunk", "chunk_list", "owned_chunks", "tensor_shard", "write_items"]

#: (global offsets, sizes, the local torch block)
Chunk = tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]


def _refuse_partial(layout: Layout, shape: Sequence[int], what: str) -> None:
    if layout.is_partial:
        raise ShardingError(
            f"Cannot {what} a Tensor of shape {tuple(shape)} laid out as {layout}: its "
            "Partial axes hold addends of the global value, not pieces of it. Reduce it "
            "first (shardwise.all_reduce(x), or x.to_torch() for a plain copy)."
        )


def owned_chunks(shards: Sequence[torch.Tensor | None], layout: Layout,
                 shape: Sequence[int], *, by_buffer: bool) -> list[Chunk]:
    """The blocks this process holds as chunks, in device order, without empty ones.
    ``by_buffer=False``: one chunk per distinct offset (what to write);
    ``by_buffer=True``: one per distinct memory region (what to fill).

    >>> from shardwise.sharding.mesh import DeviceMesh
    >>> layout = Layout(DeviceMesh.cpu(2, "x"), ((0,), ()), (None,))
    >>> blocks = [torch.zeros(3, 5), torch.zeros(2, 5)]
    >>> [(off, size) for off, size, _ in owned_chunks(blocks, layout, (5, 5), by_buffer=False)]
    [((0, 0), (3, 5)), ((3, 0), (2, 5))]
    """
    mesh = layout.mesh
    out: list[Chunk] = []
    seen: set[Any] = set()
    for k, block in enumerate(shards):
        if block is None or block.numel() == 0:
            continue
        bounds = local_bounds(shape, layout, mesh.coord_of(k))
        offsets = tuple(a for a, _ in bounds)
        if by_buffer:
            key: Any = (block.untyped_storage().data_ptr(), block.storage_offset(),
                        tuple(block.shape), block.stride(), offsets)
        else:
            key = offsets
        if key in seen:
            continue
        seen.add(key)
        out.append((offsets, tuple(b - a for a, b in bounds), block))
    return out


def write_items(fqn: str, shards: Sequence[torch.Tensor | None], layout: Layout,
                shape: Sequence[int], dtype: torch.dtype) -> list[Any]:
    """DCP write items for the blocks this process holds (``__create_write_items__``)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    _refuse_partial(layout, shape, f"save {fqn!r}:")
    chunks = [(off, size) for off, size, _ in owned_chunks(shards, layout, shape,
                                                          by_buffer=False)]
    if math.prod(shape) == 0 and any(s is not None for s in shards):
        chunks = [((0,) * len(shape), tuple(shape))]  # an empty tensor: one empty chunk
    props = TensorProperties(dtype=dtype)
    size = torch.Size(shape)
    return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(
                          chunk=ChunkStorageMetadata(offsets=torch.Size(off),
                                                     sizes=torch.Size(sz)),
                          properties=props, size=size))
            for off, sz in chunks]


def chunk_list(shards: Sequence[torch.Tensor | None], layout: Layout,
               shape: Sequence[int]) -> list[Any]:
    """The chunks DCP fills in place on load (``__create_chunk_list__``)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    # A Partial target is refused when DCP asks for the buffer (tensor_shard): DCP
    # replaces any ValueError raised here by a message about the checkpoint's metadata.
    return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size))
            for off, size, _ in owned_chunks(shards, layout, shape, by_buffer=True)]


def tensor_shard(shards: Sequence[torch.Tensor | None], layout: Layout,
                 shape: Sequence[int], index: Any) -> torch.Tensor:
    """The local tensor of the chunk ``index`` names (``__get_tensor_shard__``): on
    load ``index.index`` is the chunk's place in :func:`chunk_list` (a buffer to fill);
    on save only the offsets count (any replica holds the same values)."""
    _refuse_partial(layout, shape, f"load into or save {index.fqn!r}:")
    offsets = tuple(index.offset) if index.offset is not None else None
    if math.prod(shape) == 0:
        first = next(s for s in shards if s is not None)
        return torch.empty(tuple(shape), dtype=first.dtype, device=first.device)
    chunks = owned_chunks(shards, layout, shape, by_buffer=True)
    k = index.index
    if k is not None and 0 <= k < len(chunks) and chunks[k][0] == offsets:
        return chunks[k][2].detach()
    for off, _, block in chunks:
        if off == offsets:
            return block.detach()
    raise ShardingError(
        f"No block of {index.fqn!r} (shape {tuple(shape)}, {layout}) starts at global "
        f"offsets {offsets} in this process; it holds {[c[0] for c in chunks]}. The "
        "checkpoint plan and the state dict disagree: build the plan from this state dict."
    )
