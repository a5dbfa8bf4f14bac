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
- Checksums where the format has room, its ``__metadata__`` (strings): the key
  ``shardwise.crc32.<name>`` holds the checksum of tensor ``<name>``'s bytes (8 hex
  digits) under the algorithm that ``shardwise.checksum`` names (``crc32``; a file
  written before that key existed holds CRC-32s), and ``shardwise.crc32`` the CRC-32
  of the header itself, read with that value as ``00000000``. The header is written
  with zeros there, and after every process has written its blocks each process
  reads back its share of the tensors (every ``process_count()``-th) and writes their
  digits in place: the header's length, hence every offset, never changes (a process
  alone reads its tensors back while it fsyncs them). Other readers see ordinary
  metadata strings.
- Reading fills the targets in place: each process copies only the slices its own
  blocks cover, straight from a memory map of the file (tensors viewing its pages:
  no buffer between; a tensor whose bytes are misaligned for its dtype, or of a
  dtype torch lacks, through safetensors' ``get_slice``); shapes and dtypes must
  agree (``cast=True`` converts dtypes), a missing name raises naming it.
- The header is checked against its CRC-32 before any data is read, and every
  tensor loaded against its own, summed in chunks each just before it is copied
  (its bytes read from memory once; files without ours are read unchecked): the
  load returns only once every tensor has passed.
  Damage, and a header that safetensors cannot parse, are a ``CheckpointError``
  saying "corrupt", naming the file, the byte range and the key (after it the
  targets may hold damaged values, as any failed load leaves them unusable). An
  algorithm this version does not know is an error too (``verify=False`` skips
  the tensors' checksums).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import mmap
import os
import struct
import sys
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardwise.checkpoint import integrity
from shardwise.checkpoint.store import CheckpointError
from shardwise.runtime import world_backend
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


_CRC = "shardwise.crc32"
_ALGORITHM = "shardwise.checksum"
_ZERO = "00000000"


def _header(flat: dict[str, torch.Tensor], metadata: Mapping[str, str] | None,
            checksums: bool = True) -> tuple[bytes, dict[str, int], dict[str, int]]:
    """The length-prefixed JSON header, each tensor's byte offset in the data, and
    the byte position in the header of each CRC's 8 digits (name, or "" for the
    header's own; none with ``checksums=False``): see the module doc."""
    head: dict[str, Any] = {}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    for key in meta:
        if key.startswith(_CRC) or key == _ALGORITHM:
            raise CheckpointError(
                f"metadata key {key!r}: {_ALGORITHM!r} and the keys that begin with "
                f"{_CRC!r} hold shardwise's checksums. Rename the key."
            )
    if checksums:
        meta[_ALGORITHM] = integrity.ALGORITHM
        meta[_CRC] = _ZERO
        meta.update({f"{_CRC}.{name}": _ZERO for name in flat})
    if meta:
        head["__metadata__"] = meta
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
    digits = {}
    if checksums:
        digits = {name: _digits_at(text, f"{_CRC}.{name}") for name in flat}
        digits[""] = _digits_at(text, _CRC)
    return struct.pack("<Q", len(text)) + text, begins, digits


def _digits_at(text: bytes, key: str) -> int:
    """Where the value of metadata ``key`` (8 digits) begins in the length-prefixed header."""
    probe = (json.dumps(key) + ':"').encode()
    return 8 + text.index(probe) + len(probe)


def _header_crc(head: bytes, digits: Iterable[int]) -> int:
    """The CRC-32 of the length-prefixed header ``head`` with every CRC's digits (at
    ``digits``) read as zeros: the tensors' digits are checked against their data."""
    raw = bytearray(head)
    for at in digits:
        raw[at:at + 8] = _ZERO.encode()
    return integrity.crc32(memoryview(raw))


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
    _save_safetensors(state_dict, path, metadata, checksums=True)


def _save_safetensors(state_dict: Mapping[str, Any], path: str | os.PathLike[str],
                      metadata: Mapping[str, str] | None, *, checksums: bool) -> None:
    """:func:`save_safetensors`; ``checksums=False`` writes none (an ordinary file
    without them: the benchmarks measure what they cost, the same path either way)."""
    flat = _flatten(state_dict)
    _check_saveable(flat)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    head, begins, digits = _header(flat, metadata, checksums)
    total = len(head) + sum(t.numel() * t.dtype.itemsize for t in flat.values())
    first = world_backend().process_index() == 0
    if first:
        with open(tmp, "wb") as f:
            f.write(head)
            f.truncate(total)  # sized (sparse) before any process writes its blocks
    world_backend().barrier("shardwise.checkpoint.save_safetensors: header")
    # a process alone reads its CRC-32s back on a thread while the fsync waits for the
    # disk (with peers, only once they have all written theirs)
    summer = (ThreadPoolExecutor(1, thread_name_prefix="shardwise-crc32")
              if checksums and world_backend().process_count() == 1 else None)
    with contextlib.ExitStack() as stack:
        if summer is not None:
            stack.callback(summer.shutdown, wait=True)
        sums = _write_data(tmp, head, begins, flat, first, summer)
        world_backend().barrier("shardwise.checkpoint.save_safetensors: written")
        if checksums:
            _write_checksums(tmp, head, digits, _sums(tmp, head, begins, flat)
                             if sums is None else sums.result())
            world_backend().barrier("shardwise.checkpoint.save_safetensors: checksummed")
    if first:
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    world_backend().barrier("shardwise.checkpoint.save_safetensors: published")


def _write_data(tmp: Path, head: bytes, begins: dict[str, int], flat: dict[str, Any],
                first: bool, summer: ThreadPoolExecutor | None
                ) -> concurrent.futures.Future[dict[str, int]] | None:
    """Write this process's blocks and fsync them; with ``summer``, their CRC-32s are
    read back on it meanwhile (:func:`_sums`), returned as a future."""
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
        sums = None if summer is None else summer.submit(_sums, tmp, head, begins, flat)
        os.fsync(fd)  # this process's bytes are on disk before anyone publishes the file
    finally:
        os.close(fd)
    return sums


def _sums(tmp: Path, head: bytes, begins: dict[str, int], flat: dict[str, torch.Tensor]
          ) -> dict[str, int]:
    """The CRC-32s of this process's share of the tensors (every ``process_count()``-th),
    read back from the file where the page cache holds it."""
    me, count = world_backend().process_index(), world_backend().process_count()
    sums = {}
    with (open(tmp, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm,
          memoryview(mm) as view):
        for n, (name, t) in enumerate(flat.items()):
            if n % count == me:
                begin = len(head) + begins[name]
                with view[begin:begin + t.numel() * t.dtype.itemsize] as part:
                    sums[name] = integrity.crc32(part)
    return sums


def _write_checksums(tmp: Path, head: bytes, digits: dict[str, int], sums: dict[str, int]
                     ) -> None:
    """This process's CRC-32s ``sums``, written into the header's reserved digits (see
    the module doc)."""
    fd = os.open(tmp, os.O_RDWR)
    try:
        for name, crc in sums.items():
            os.pwrite(fd, b"%08x" % crc, digits[name])
        if world_backend().process_index() == 0:
            os.pwrite(fd, b"%08x" % _header_crc(head, digits.values()), digits[""])
        os.fsync(fd)
    finally:
        os.close(fd)


def load_safetensors(path: str | os.PathLike[str], state_dict: Mapping[str, Any], *,
                     strict: bool = True, cast: bool = False, verify: bool = True
                     ) -> list[str]:
    """Fill the tensors of ``state_dict`` in place from the safetensors file at
    ``path``: each process copies only the slices its blocks hold, from a memory map
    of the file, so pretrained weights load straight into a sharded model. Returns
    the names the file lacked (an error unless ``strict=False``); ``cast=True``
    converts dtypes. Each tensor loaded is checked against the CRC-32
    ``save_safetensors`` recorded, summed as it is copied, before the load
    returns (a damaged file raises :class:`CheckpointError`; the targets' values are
    then not to be used); ``verify=False`` skips that (the header's own checksum is
    still checked).

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
    checks, entries = _parse(Path(path), verify)
    try:
        opened = safe_open(str(path), framework="pt")  # its checks of the header
    except Exception as err:  # safetensors' own error type varies across versions
        raise CheckpointError(
            f"{path} is corrupt: safetensors cannot read its header ({err}). Restore the "
            "file."
        ) from err
    with (opened as f, open(path, "rb") as raw, torch.no_grad(),
          contextlib.ExitStack() as stack):
        mapped = _Mapped(raw)
        stack.callback(mapped.close)
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
            check = checks.get(name) if verify else None
            source = mapped.tensor(*entries[name])
            if source is None:  # a dtype or an alignment a view cannot take
                _load_one(f, name, target, cast)
                if check is not None:
                    _verify(Path(path), [(name, *check)], mapped.view)
                continue
            kind, _, begin, end = entries[name]
            got = _fill(name, source, kind, target, cast,
                        _Rows(mapped.view, begin, end, check is not None))
            if check is not None and got != check[2]:
                # nothing returns unchecked: the targets' values are then not to be used
                raise CheckpointError(
                    f"Key {name!r}: its data in {path} bytes {begin}..{end} is corrupt "
                    f"(their CRC-32 is {got:08x}, the header recorded {check[2]:08x}). "
                    "Restore the file.")
    return missing


class _Mapped:
    """The file's bytes, memory-mapped once (copy-on-write, never written: torch wants
    a writable buffer), as tensors viewing them: a block is copied straight from the
    page cache, with no buffer between."""

    def __init__(self, raw: Any) -> None:
        size = os.fstat(raw.fileno()).st_size
        self.mm = mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self.view = memoryview(self.mm if self.mm is not None else b"")

    def tensor(self, kind: str, shape: tuple[int, ...], begin: int, end: int
               ) -> torch.Tensor | None:
        """Bytes ``begin..end`` as a tensor of safetensors dtype ``kind`` and ``shape``
        (``None``: a dtype torch lacks here, a misaligned start, or a big-endian host)."""
        dtype = _BY_NAME.get(kind)
        if (dtype is None or self.mm is None or begin % dtype.itemsize
                or sys.byteorder != "little"):
            return None
        if not 0 <= begin <= end <= len(self.mm) or end - begin != (
                math.prod(shape) * dtype.itemsize) or min(shape, default=0) < 0:
            return None  # not what safetensors checked: let it read (and judge) the bytes
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(self.mm, dtype=torch.uint8, count=end - begin, offset=begin)
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        self.view.release()
        if self.mm is not None:
            with contextlib.suppress(BufferError):  # a view still alive: closed when freed
                self.mm.close()


def _plain_target(name: str, shape: tuple[int, ...], dtype: torch.dtype | None, kind: str,
                  target: torch.Tensor, cast: bool) -> bool:
    """Check that the file's tensor (``shape``, ``dtype``, named ``kind`` in the file)
    fits ``target``; True when the target is a plain torch tensor (copied whole)."""
    if shape != tuple(target.shape) or (dtype != target.dtype and not cast):
        raise CheckpointError(
            f"Key {name!r}: the file holds shape {shape} {kind} but the target "
            f"has shape {tuple(target.shape)} {target.dtype}. Build the target with the "
            "file's shape (cast=True converts dtypes)."
        )
    if not isinstance(target, Tensor):
        return True
    if target.dist_layout.is_partial:
        raise CheckpointError(
            f"Key {name!r}: the target {target!r} is Partial (its blocks are addends); "
            "load into a Replicated or Sharded tensor."
        )
    return False


_CHUNK = 8 << 20   # bytes summed, then copied while the cache still holds them


@dataclass
class _Rows:
    """Where a tensor's bytes lie in the file's map, and whether to sum them."""

    view: memoryview
    begin: int
    end: int
    summed: bool


def _fill(name: str, source: torch.Tensor, kind: str, target: torch.Tensor, cast: bool,
          rows: _Rows) -> int:
    """Copy the file's tensor ``source`` into ``target``'s blocks (each its slice); the
    CRC-32 of its bytes when ``rows.summed`` (else 0).

    The bytes are summed in chunks of rows, each just before it is copied, so they are
    read from memory once (a second pass over the page cache costs as much as the copy
    itself; summing on another thread did, on two cores: the copy already uses both)."""
    shape = tuple(source.shape)
    if _plain_target(name, shape, source.dtype, kind, target, cast):
        blocks: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]] = [
            ((0,) * len(shape), shape, target)]
    else:
        assert isinstance(target, Tensor)
        blocks = list(owned_chunks(target.shards, target.dist_layout, shape, by_buffer=True))
    if not shape:  # a 0-d tensor: one value
        for _, _, block in blocks:
            block.copy_(source)
        return integrity.crc32(rows.view[rows.begin:rows.end]) if rows.summed else 0
    return _copy_rows(source, blocks, 0, shape[0], rows)


def _copy_rows(source: torch.Tensor, blocks: list[tuple[tuple[int, ...], tuple[int, ...],
                                                        torch.Tensor]],
               r0: int, r1: int, rows: _Rows) -> int:
    """Rows ``r0..r1`` of ``source`` into the blocks that hold them; the CRC-32 of those
    rows' bytes when ``rows.summed`` (else 0)."""
    if r1 <= r0:  # no rows (a size-0 tensor): no bytes, whose CRC-32 is 0
        return 0
    row = (rows.end - rows.begin) // source.shape[0]
    step = max(1, _CHUNK // max(row, 1))
    crc = 0
    for a in range(r0, r1, step):
        b = min(r1, a + step)
        if rows.summed:
            crc = integrity.crc32(rows.view[rows.begin + a * row:rows.begin + b * row], crc)
        for offsets, sizes, block in blocks:
            lo, hi = max(a, offsets[0]), min(b, offsets[0] + sizes[0])
            if lo < hi:
                block[lo - offsets[0]:hi - offsets[0]].copy_(
                    _slice(source, (lo, *offsets[1:]), (hi - lo, *sizes[1:])))
    return crc


def _slice(source: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]
           ) -> torch.Tensor:
    """The block at ``offsets`` of ``sizes`` of ``source`` (a view: nothing is read)."""
    return source[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]


def _checks(path: Path, verify: bool = True) -> dict[str, tuple[int, int, int, str]]:
    """``{name: (first byte, end, checksum, algorithm)}`` of the file's checksummed
    tensors (see :func:`_parse`)."""
    return _parse(path, verify)[0]


def _parse(path: Path, verify: bool = True
           ) -> tuple[dict[str, tuple[int, int, int, str]],
                      dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """``{name: (first byte, end, checksum, algorithm)}`` of the file's checksummed
    tensors, once its header matches its own CRC-32 (``{}`` for a file written without
    them) and their algorithm is one this version knows (unless ``verify=False``); and
    ``{name: (dtype, shape, first byte, end)}`` of every tensor (safetensors checks
    those against the file)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        text = f.read(n) if 0 < n <= 100_000_000 else b""
    try:
        if len(text) != n:
            raise ValueError(f"the header should be {n} bytes; the file has {len(text)}")
        head = json.loads(text)
        start = 8 + n
        entries = {name: (str(e["dtype"]), tuple(int(d) for d in e["shape"]),
                          start + int(e["data_offsets"][0]), start + int(e["data_offsets"][1]))
                   for name, e in head.items() if name != "__metadata__"}
        meta = head.get("__metadata__") or {}
        if _CRC not in meta:
            return {}, entries
        digits = [_digits_at(text, key) for key in meta if key.startswith(_CRC)]
        expected = int(meta[_CRC], 16)
        got = _header_crc(prefix + text, digits)
        if got != expected:
            raise ValueError(f"its CRC-32 is {got:08x}, the header recorded {expected:08x}")
        algorithm = str(meta.get(_ALGORITHM, "crc32"))  # written before the key existed: CRC-32
        checks = {name: (start + entry["data_offsets"][0], start + entry["data_offsets"][1],
                       int(meta[f"{_CRC}.{name}"], 16), algorithm)
                  for name, entry in head.items() if f"{_CRC}.{name}" in meta}
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        raise CheckpointError(
            f"The header of {path} (bytes 0..{8 + max(n, 0)}) is corrupt ({err}). Restore "
            "the file."
        ) from None
    unknown = verify and integrity.unknown_algorithm(
        algorithm, str(path), f"header metadata {_ALGORITHM!r}", "tensors'", "tensors")
    if unknown:
        raise CheckpointError(unknown)
    return checks, entries


def _verify(path: Path, tensors: list[tuple[str, int, int, int, str]],
            mapped: memoryview | None = None) -> None:
    """Check each ``(name, first byte, end, checksum, algorithm)`` of ``path`` (through
    ``mapped``, a map of the file, else its own); the first that fails raises, naming it."""
    if not tensors:
        return
    failed = integrity.check_chunks(path, [(b, e, c) for _, b, e, c, _ in tensors],
                                    tensors[0][4], mapped)
    for n, (name, begin, end, _, _) in enumerate(tensors):
        err = failed.get(n)
        if err is not None:
            raise CheckpointError(
                f"Key {name!r}: its data in {path} bytes {begin}..{end} is corrupt "
                f"({err.why.replace('metadata', 'header')}). Restore the file."
            )


def _load_one(f: Any, name: str, target: torch.Tensor, cast: bool) -> None:
    part = f.get_slice(name)
    shape, dtype = tuple(part.get_shape()), _BY_NAME.get(part.get_dtype())
    if _plain_target(name, shape, dtype, part.get_dtype(), target, cast):
        target.copy_(f.get_tensor(name))
        return
    assert isinstance(target, Tensor)
    for offsets, sizes, block in owned_chunks(target.shards, target.dist_layout, shape,
                                              by_buffer=True):
        index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
        block.copy_(part[index] if index else f.get_tensor(name))
