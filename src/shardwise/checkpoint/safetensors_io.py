"""One consolidated safetensors file of global tensors, written by offsets, read by slices.

Invariants:
- The file is an ordinary safetensors file: each name holds the *global* tensor
  (row-major), so ``safetensors.torch.load_file`` or Hugging Face code read it as is.
- Writing never gathers: process 0 writes the header and sizes the file, then every
  process writes the blocks it holds straight to their global offsets (``pwrite`` of
  each contiguous run), each block once (the representative of its replicas),
  plain torch tensors by process 0. No process holds more than its own blocks.
  The file appears under its name only when every process is done (temporary name,
  barrier, rename).
- Reading fills the targets in place: each process reads, with ``get_slice``, only the
  slices its own blocks cover (one slice in memory at a time); shapes and dtypes
  must agree (``cast=True`` converts dtypes), a missing name raises naming it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardwise.api import distributed
from shardwise.checkpoint.store import CheckpointError
from shardwise.tensors.chunks import owned_chunks
from shardwise.tensors.tensor import Tensor

__all__ = ["load_safetensors", "save_safetensors"]

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
# the bytes of an element, seen as an integer of the same width (numpy has no bfloat16)
_RAW = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32),
        8: (torch.int64, np.int64)}


def _flatten(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _header(flat: dict[str, torch.Tensor], metadata: Mapping[str, str] | None
            ) -> tuple[bytes, dict[str, int]]:
    """The length-prefixed JSON header and each tensor's byte offset in the data."""
    head: dict[str, Any] = {}
    if metadata:
        head["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    begins: dict[str, int] = {}
    pos = 0
    for name, t in flat.items():
        size = t.numel() * t.dtype.itemsize
        head[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                      "data_offsets": [pos, pos + size]}
        begins[name] = pos
        pos += size
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads
    return struct.pack("<Q", len(text)) + text, begins


def _check_saveable(flat: dict[str, Any]) -> None:
    for name, value in flat.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"Key {name!r} holds a {type(value).__name__}; a safetensors file holds "
                "tensors only. Leave it out, or put strings in metadata=."
            )
        if value.dtype not in _DTYPES:
            raise CheckpointError(
                f"Key {name!r} has dtype {value.dtype}, which safetensors cannot hold here "
                f"(supported: {', '.join(sorted(_DTYPES.values()))}). Convert it first."
            )
        if isinstance(value, Tensor) and value.dist_layout.is_partial:
            raise CheckpointError(
                f"Key {name!r}: {value!r} is Partial (its blocks are addends). Reduce it "
                "first with shardwise.all_reduce(x)."
            )


def _write_block(fd: int, start: int, shape: tuple[int, ...], offsets: tuple[int, ...],
                 block: torch.Tensor) -> None:
    """Write ``block`` at ``offsets`` of the row-major tensor of ``shape`` whose bytes
    begin at ``start``: one ``pwrite`` per contiguous run of the file (one in all for a
    block of whole rows; one per row of a block cut along a later dim)."""
    raw_t, _ = _RAW[block.dtype.itemsize]
    data = block.detach().cpu().contiguous().view(raw_t).numpy()
    size = block.dtype.itemsize
    # dims after the last partial one are whole: from that dim on a run is contiguous
    k = max((d for d in range(len(shape)) if block.shape[d] != shape[d]), default=0)
    runs = data.reshape(-1, math.prod(block.shape[k:])) if data.size else data.reshape(0, 0)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    for n, lead in enumerate(np.ndindex(*block.shape[:k])):
        first = sum((o + i) * st for o, i, st in zip(offsets, lead, strides, strict=False))
        first += offsets[k] * strides[k] if shape else 0
        os.pwrite(fd, memoryview(runs[n]).cast("B"), start + first * size)


def save_safetensors(state_dict: Mapping[str, Any], path: str | os.PathLike[str], *,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write ``state_dict`` (names -> shardwise or torch tensors; nested dicts join
    names with ".") as one safetensors file of global tensors at ``path``. Every
    process calls it; each writes only its own blocks at their offsets.

    >>> import tempfile, safetensors.torch
    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> w = shardwise.tensor(torch.arange(35.).reshape(7, 5),
    ...                      sharding=PlacementMapping(mesh, [Sharded(0), Sharded(1)]))
    >>> f = tempfile.mkdtemp() + "/model.safetensors"
    >>> shardwise.checkpoint.save_safetensors({"w": w, "b": torch.ones(2)}, f)
    >>> torch.equal(safetensors.torch.load_file(f)["w"], w.to_torch())
    True
    """
    flat = _flatten(state_dict)
    _check_saveable(flat)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    head, begins = _header(flat, metadata)
    total = len(head) + sum(t.numel() * t.dtype.itemsize for t in flat.values())
    first = distributed.process_index() == 0
    if first:
        with open(tmp, "wb") as f:
            f.write(head)
            f.truncate(total)  # sized (sparse) before any process writes its blocks
    distributed.barrier("shardwise.checkpoint.save_safetensors: header")
    fd = os.open(tmp, os.O_WRONLY)
    try:
        for name, t in flat.items():
            start, shape = len(head) + begins[name], tuple(t.shape)
            if isinstance(t, Tensor):
                reps = t.dist_layout.representatives()
                mine = [s if s is not None and reps[k] == k else None
                        for k, s in enumerate(t.shards)]
                for offsets, _, block in owned_chunks(mine, t.dist_layout, shape,
                                                      by_buffer=False):
                    _write_block(fd, start, shape, offsets, block)
            elif first and t.numel():
                _write_block(fd, start, shape, (0,) * len(shape), t)
        os.fsync(fd)  # this process's bytes are on disk before anyone publishes the file
    finally:
        os.close(fd)
    distributed.barrier("shardwise.checkpoint.save_safetensors: written")
    if first:
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    distributed.barrier("shardwise.checkpoint.save_safetensors: published")


def load_safetensors(path: str | os.PathLike[str], state_dict: Mapping[str, Any], *,
                     strict: bool = True, cast: bool = False) -> list[str]:
    """Fill the tensors of ``state_dict`` in place from the safetensors file at
    ``path``: each process reads only the slices its blocks hold (``get_slice``), so
    pretrained weights load straight into a sharded model. Returns the names the file
    lacked (an error unless ``strict=False``); ``cast=True`` converts dtypes.

    >>> import tempfile, safetensors.torch
    >>> f = tempfile.mkdtemp() + "/w.safetensors"
    >>> safetensors.torch.save_file({"w": torch.arange(6.)}, f)
    >>> w = shardwise.zeros(6, sharding=PlacementMapping(DeviceMesh.cpu(3, "x"), [Sharded(0)]))
    >>> shardwise.checkpoint.load_safetensors(f, {"w": w})
    []
    >>> [s.tolist() for s in w.shards]
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    """
    from safetensors import safe_open

    flat = _flatten(state_dict)
    missing: list[str] = []
    if not Path(path).exists():
        raise CheckpointError(f"No safetensors file at {path}. Check the path.")
    with safe_open(str(path), framework="pt") as f, torch.no_grad():
        names = set(f.keys())
        for name, target in flat.items():
            if not isinstance(target, torch.Tensor):
                continue
            if name not in names:
                if strict:
                    raise CheckpointError(
                        f"Key {name!r} is not in {path} ({len(names)} tensors there). Pass "
                        "strict=False to keep the target's value, or rename the key."
                    )
                missing.append(name)
                continue
            _load_one(f, name, target, cast)
    return missing


def _load_one(f: Any, name: str, target: torch.Tensor, cast: bool) -> None:
    part = f.get_slice(name)
    shape, dtype = tuple(part.get_shape()), _BY_NAME.get(part.get_dtype())
    if shape != tuple(target.shape) or (dtype != target.dtype and not cast):
        raise CheckpointError(
            f"Key {name!r}: the file holds shape {shape} {part.get_dtype()} but the target "
            f"has shape {tuple(target.shape)} {target.dtype}. Build the target with the "
            "file's shape (cast=True converts dtypes)."
        )
    if not isinstance(target, Tensor):
        target.copy_(f.get_tensor(name))
        return
    if target.dist_layout.is_partial:
        raise CheckpointError(
            f"Key {name!r}: the target {target!r} is Partial (its blocks are addends); "
            "load into a Replicated or Sharded tensor."
        )
    for offsets, sizes, block in owned_chunks(target.shards, target.dist_layout, shape,
                                              by_buffer=True):
        index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
        block.copy_(part[index] if index else f.get_tensor(name))
