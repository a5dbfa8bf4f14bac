"""Checksums of DCP checkpoints: a CRC-32 per written chunk, recorded in the metadata.

Invariants:
- :class:`ChecksummedWriter` is DCP's ``FileSystemWriter``; every chunk it writes (a
  tensor block's ``torch.save`` record or a non-tensor value's bytes, i.e. one
  ``_StorageInfo`` byte range of a ``.distcp`` file) gets the CRC-32 of exactly those
  bytes as the attribute ``shardwise_crc32`` of its ``_StorageInfo`` in ``.metadata``,
  and the metadata names the algorithm of those checksums, ``"crc32"``, as its
  attribute ``shardwise_checksum`` (:data:`ALGORITHMS` lists those a reader knows;
  metadata without the attribute, written before it existed, holds CRC-32s).
  The CRC is taken from the bytes as they go to the file (no second read), except
  where a range does not match one written stretch (a format DCP may add later):
  then the range is read back from the file.
- CRC-32 is zlib's (CRC-32/ISO-HDLC): :func:`crc32` returns ``zlib.crc32``'s value,
  computed by zlib-ng (a dependency: carry-less-multiply folding, several times zlib
  1.2's speed) where it is installed, else by zlib. The files are the same either way.
- ``.metadata`` ends with a trailer, ``shardwise.crc32=`` and the 8 hex digits of the
  CRC-32 of the pickle before it. ``pickle.load`` stops at the pickle's end, so DCP's
  own reader (``dcp.load``, other tools) reads the file, and ignores the extra
  attributes, unchanged: a checksummed checkpoint is an ordinary DCP checkpoint.
- The zip records ``torch.save`` writes inside a chunk carry no CRC-32 of their own
  (``torch.serialization.set_crc32_options(False)`` while writing): nothing checked
  them, and the chunk's CRC-32 takes their place at a fraction of the cost.
- :func:`check_chunk` passes a chunk only if its bytes are all there and match their
  CRC-32 (chunks without one, written by plain ``dcp.save``, only if they are all
  there and are not all zero bytes); otherwise it raises :class:`Corrupt`, which the
  reader turns into a ``CheckpointError`` naming the key, file and byte range.
  :class:`SummingView` sums a chunk as DCP's reader reads it (the store checks it
  before any of its values reaches a target); :func:`check_chunks` checks a file's
  chunks through one memory map (the safetensors loader runs it for a tensor it
  reads through safetensors itself; it sums the others as it copies them). A file
  changed between a check and a read is outside what this guards: damage at rest.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

__all__ = ["ALGORITHM", "ALGORITHMS", "ALGORITHM_ATTR", "ATTR", "ChecksummedWriter", "Corrupt",
           "SummingView", "check_chunk", "check_chunks", "check_info", "combine", "crc32",
           "split_trailer", "unknown_algorithm"]

ATTR = "shardwise_crc32"  # the _StorageInfo attribute (namespaced: DCP owns the class)
ALGORITHM_ATTR = "shardwise_checksum"  # the Metadata attribute naming the algorithm
ALGORITHM = "crc32"  # what this version writes
_TRAILER = b"shardwise.crc32="
_TRAILER_LEN = len(_TRAILER) + 8
_METADATA_TMP = ".metadata.tmp"  # the name DCP's finish() writes before its rename


# --- CRC-32, fast ------------------------------------------------------------------------------
# zlib 1.2's crc32 runs slower on one core than a load from the page cache; zlib-ng's
# computes the same CRC with carry-less multiplies (PCLMULQDQ/VPCLMULQDQ on x86-64,
# PMULL on ARM), several times faster. Both release the GIL for large buffers. Without
# zlib-ng, pieces of a large buffer are summed on several threads and their CRCs combined
# (zlib's crc32_combine, which Python's zlib does not expose).
_crc32: Callable[..., int]
try:
    from zlib_ng import zlib_ng as _zlib_ng

    _crc32, FAST = _zlib_ng.crc32, True
except ImportError:  # an install without the dependency: the same values, slower
    _crc32, FAST = zlib.crc32, False
_POLY = 0xEDB88320  # CRC-32's polynomial, reflected
_PIECE = 8 << 20


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo CRC-32's polynomial (reflected bit order, as zlib's)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's
    ``crc32_combine``, which Python's zlib does not expose).

    >>> combine(zlib.crc32(b"shard"), zlib.crc32(b"wise"), 4) == zlib.crc32(b"shardwise")
    True
    """
    p, n, k = 1 << 31, len2, 3  # x^(8 * len2)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the process that made it, pool)


def crc32(data: bytes | memoryview, value: int = 0) -> int:
    """``zlib.crc32(data, value)``: by zlib-ng where installed, else large buffers in
    pieces on several threads."""
    global _pool
    view = memoryview(data).cast("B")
    n = 1 if FAST else min(os.cpu_count() or 1, 8, len(view) // _PIECE)
    if n < 2:
        return _crc32(view, value)
    if _pool is None or _pool[0] != os.getpid():  # a forked child has none of its threads
        _pool = (os.getpid(), ThreadPoolExecutor(min(os.cpu_count() or 1, 8),
                                                 thread_name_prefix="shardwise-crc32"))
    step = -(-len(view) // n)
    pieces = [view[i:i + step] for i in range(0, len(view), step)]
    crc = value
    for piece, part in zip(pieces, _pool[1].map(zlib.crc32, pieces)):
        crc = combine(crc, part, len(piece))
    return crc


ALGORITHMS: dict[str, Callable[[memoryview], int]] = {"crc32": crc32}


def unknown_algorithm(algorithm: object, whose: str, recorded_in: str, of: str, items: str
                      ) -> str | None:
    """None when this version checks ``algorithm``, else the error saying so and naming
    the two ways out (both formats' loaders raise it as a ``CheckpointError``).

    >>> unknown_algorithm("crc32", "x", "y", "chunk", "chunks") is None
    True
    >>> why = unknown_algorithm("xxh3", "f.safetensors", "header metadata 'k'", "tensors'",
    ...                         "tensors")
    >>> (why.startswith("f.safetensors records its tensors' checksums as 'xxh3'"),
    ...  "(it knows 'crc32')" in why, why.endswith("without checking the tensors."))
    (True, True, True)
    """
    if isinstance(algorithm, str) and algorithm in ALGORITHMS:
        return None
    known = ", ".join(repr(a) for a in ALGORITHMS)
    return (f"{whose} records its {of} checksums as {algorithm!r} ({recorded_in}), an "
            f"algorithm this version of shardwise cannot check (it knows {known}). Load it "
            "with the shardwise that wrote it, or pass verify=False to load it without "
            f"checking the {items}.")


class Corrupt(Exception):
    """A chunk's bytes are not what was written (the reader names the key)."""

    def __init__(self, file: Path, begin: int, end: int, why: str) -> None:
        super().__init__(f"{file} bytes {begin}..{end}: {why}")
        self.file, self.begin, self.end, self.why = file, begin, end, why


class _Summing(io.RawIOBase):
    """A file being written that keeps the CRC-32 of each stretch between two
    ``tell()`` calls: DCP's ``_write_item`` calls ``tell()`` right before and right
    after each chunk, so a stretch is one chunk (checked again when it is used).
    Each buffer is summed right before it is written: the write then reads it from
    the cache (with zlib-ng the CRC costs a small part of the write). The metadata file
    (``trailer``) gets its trailer when DCP asks for the descriptor to fsync it (the
    pickle is complete then; one fsync covers both), else when it is closed."""

    def __init__(self, raw: IO[bytes], trailer: bool) -> None:
        super().__init__()
        self.raw, self.trailer = raw, trailer
        self.pos = self.mark = self.crc = 0
        self.whole = 0  # the CRC of everything written (the metadata trailer's)
        self.sealed = False  # the trailer is written
        self.stretches: dict[int, tuple[int, int]] = {}  # begin -> (end, crc)

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        if self.sealed:
            raise OSError("shardwise: a write to the checkpoint metadata after its trailer")
        view = memoryview(b).cast("B")
        self.crc = _crc32(view, self.crc)
        if self.trailer:
            self.whole = _crc32(view, self.whole)
        n = self.raw.write(view)
        self.pos += len(view)
        return len(view) if n is None else n

    def tell(self) -> int:
        if self.pos > self.mark:
            self.stretches[self.mark] = (self.pos, self.crc)
        self.mark, self.crc = self.pos, 0
        return self.pos

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        self.seal()
        return self.raw.fileno()

    def seal(self) -> None:
        """Write the metadata's trailer (for a data file, nothing)."""
        if self.trailer and not self.sealed:
            self.raw.write(_TRAILER + b"%08x" % self.whole)
            self.raw.flush()
            self.sealed = True


class _SummingFileSystem(FileSystem):
    """DCP's local file system, summing what it writes (see :class:`_Summing`)."""

    def __init__(self) -> None:
        super().__init__()
        self.stretches: dict[str, dict[int, tuple[int, int]]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str
                      ) -> Iterator[io.IOBase]:
        path = Path(path)
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        trailer = path.name == _METADATA_TMP
        with open(path, mode) as raw:
            summing = _Summing(raw, trailer)
            yield summing
            if trailer and not summing.sealed:  # before DCP renames it to .metadata
                summing.seal()
                os.fsync(raw.fileno())
        self.stretches[path.name] = summing.stretches


@contextlib.contextmanager
def _zip_crc_off() -> Iterator[None]:
    """``torch.save`` without the CRC-32 of each zip record: no reader checks those
    (``torch.load`` does not), and ours, which covers the whole chunk and is checked,
    costs the same pass over the bytes; so the save costs what it did. The option is
    torch's global (a ``torch.save`` in another thread meanwhile also skips it)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class ChecksummedWriter(dcp.FileSystemWriter):
    """``dcp.FileSystemWriter`` recording each chunk's CRC-32 in the metadata.
    ``checksums=False`` writes none (a plain DCP checkpoint, as fast as one can be:
    the zip records' CRC-32s stay off too), to measure what the checksums cost."""

    def __init__(self, path: str | os.PathLike[str], *, checksums: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.checksums = checksums
        if checksums:
            self.fs = _SummingFileSystem()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with _zip_crc_off():
            results = super().write_data(plan, planner).wait()
        if self.checksums:
            assert isinstance(self.fs, _SummingFileSystem)
            for result in results:
                info = result.storage_data
                end = info.offset + info.length
                known = self.fs.stretches.get(info.relative_path, {}).get(info.offset)
                if known is not None and known[0] == end:
                    crc = known[1]
                else:  # not one written stretch: read the range back
                    with open(Path(self.path) / info.relative_path, "rb") as f:
                        f.seek(info.offset)
                        crc = crc32(f.read(info.length))
                setattr(info, ATTR, crc)
            self.fs.stretches.clear()
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.checksums:
            setattr(metadata, ALGORITHM_ATTR, ALGORITHM)  # pickled with the metadata
        super().finish(metadata, results)


def split_trailer(data: bytes) -> tuple[bytes, int | None]:
    """``.metadata``'s pickle and the CRC-32 its trailer records (``None``: no trailer,
    a checkpoint written by plain ``dcp.save``, or a damaged one, whose bytes then
    trail the pickle and fail the reader)."""
    tail = data[-_TRAILER_LEN:]
    digits = tail[len(_TRAILER):]
    if (len(data) >= _TRAILER_LEN and tail.startswith(_TRAILER)
            and all(c in b"0123456789abcdef" for c in digits)):  # exactly as written
        return data[:-_TRAILER_LEN], int(digits, 16)
    return data, None


_SMALL = 1 << 20  # a smaller chunk is read, not mapped: setting a map up costs more


def check_chunk(path: Path, begin: int, end: int, expected: int | None,
                algorithm: str = ALGORITHM) -> None:
    """Raise :class:`Corrupt` unless bytes ``begin..end`` of ``path`` are all there and
    match their checksum ``expected`` under ``algorithm`` (one of :data:`ALGORITHMS`;
    ``None``: a chunk written without one, which must then not be all zero bytes).
    A large chunk is read through a memory map: its bytes are summed where the page
    cache holds them, never copied."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < end:
            raise Corrupt(path, begin, end, f"the file ends after {max(size - begin, 0)} of "
                          "them (truncated)")
        if end == begin:
            return
        if end - begin < _SMALL:
            _judge(path, begin, end, memoryview(os.pread(f.fileno(), end - begin, begin)),
                   expected, algorithm)
            return
        with (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm,
              memoryview(mm) as whole, whole[begin:end] as view):
            _judge(path, begin, end, view, expected, algorithm)


def check_chunks(path: Path, chunks: Iterable[tuple[int, int, int | None]],
                 algorithm: str = ALGORITHM, mapped: memoryview | None = None
                 ) -> dict[int, Corrupt]:
    """:func:`check_chunk` of each ``(begin, end, expected)`` of ``path``, in that order,
    through one memory map of the file (no setup per chunk; ``mapped``: the caller's
    map of the whole file, whose pages it reads too: mapped once): the failures, by
    position in ``chunks`` (empty: every chunk passed)."""
    failed: dict[int, Corrupt] = {}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        own = mapped is None and size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if own else None
        whole = memoryview(mm if mm is not None else b"") if mapped is None else mapped
        size = min(size, len(whole))
        try:
            for n, (begin, end, expected) in enumerate(chunks):
                if size < end:
                    failed[n] = Corrupt(path, begin, end, "the file ends after "
                                            f"{max(size - begin, 0)} of them (truncated)")
                    continue
                with whole[begin:end] as view:
                    try:
                        _judge(path, begin, end, view, expected, algorithm)
                    except Corrupt as err:
                        failed[n] = err
        finally:
            if mapped is None:
                whole.release()
            if mm is not None:
                mm.close()
    return failed


def _judge(path: Path, begin: int, end: int, view: memoryview, expected: int | None,
           algorithm: str) -> None:
    if len(view) != end - begin:  # the file shrank since its size was read
        raise Corrupt(path, begin, end, f"only {len(view)} of them could be read (truncated)")
    if expected is not None:
        got = ALGORITHMS[algorithm](view)
        if got != expected:
            name = "CRC-32" if algorithm == "crc32" else algorithm
            raise Corrupt(path, begin, end, f"their {name} is {got:08x}, the "
                          f"metadata recorded {expected:08x}")
    elif not any(view[:4096]) and not any(view):
        raise Corrupt(path, begin, end, "they are all zero bytes")


_FUSE = 64 << 10  # a read at least this long is summed as it lands
_GAP = 1 << 20  # unsummed bytes before such a read that are read to sum them first
_STEP = 1 << 20  # a fused read goes in pieces, each summed while the core's cache holds it


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from byte ``offset`` of ``fd`` (short only at the file's end)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class SummingView(io.RawIOBase):
    """Bytes ``begin..end`` of the open file ``fd`` as a seekable stream, read with
    ``pread`` (the descriptor's own position is never used), that sums the bytes as
    they land: a long read (the chunk's data record) is read in pieces, each summed
    while the core's cache still holds it, after summing the few bytes before it
    (zip headers, the pickle) once; :meth:`check` sums what the reader skipped and
    compares. So a chunk is checked with no second pass over its bytes (half the
    cost of one). ``expected=None`` (a chunk without a checksum) or another
    algorithm: :meth:`check` is :func:`check_chunk`; ``summing=False``: a plain view."""

    def __init__(self, fd: int, path: Path, begin: int, end: int, expected: int | None,
                 algorithm: str = ALGORITHM, *, summing: bool = True) -> None:
        super().__init__()
        self.fd, self.path, self.begin, self.end = fd, path, begin, end
        self.expected, self.algorithm = expected, algorithm
        self.summing = summing and expected is not None and algorithm == "crc32"
        self.pos = self.upto = self.crc = 0  # upto: the chunk's bytes summed so far

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.end - self.begin}
        self.pos = max(base[whence] + offset, 0)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        p = self.pos
        view = view[:max(min(len(view), self.end - self.begin - p), 0)]
        if self.summing and len(view) >= _FUSE and self.upto <= p <= self.upto + _GAP:
            self._sum_to(p)
            n = 0
            for i in range(0, len(view), _STEP):
                with view[i:i + _STEP] as piece:
                    got = _pread_into(self.fd, piece, self.begin + p + i)
                    self.crc = crc32(piece[:got], self.crc)
                    short = got < len(piece)
                n += got
                if short:
                    break
            self.upto = p + n
        else:
            n = _pread_into(self.fd, view, self.begin + p)
        self.pos = p + n
        return n

    def readall(self) -> bytes:
        out = bytearray(max(self.end - self.begin - self.pos, 0))
        return bytes(out[:self.readinto(out)])

    def _sum_to(self, stop: int) -> None:
        """Sum the chunk's bytes ``upto..stop`` (read here: the reader skipped them)."""
        if self.upto >= stop:
            return
        scratch = bytearray(min(_STEP, stop - self.upto))
        while self.upto < stop:
            with memoryview(scratch)[:min(_STEP, stop - self.upto)] as piece:
                got = _pread_into(self.fd, piece, self.begin + self.upto)
                self.crc = crc32(piece[:got], self.crc)
                short = got < len(piece)
            self.upto += got
            if short:
                raise Corrupt(self.path, self.begin, self.end, "the file ends after "
                              f"{self.upto} of them (truncated)")

    def check(self) -> None:
        """Raise :class:`Corrupt` unless the chunk's bytes match their checksum."""
        if not self.summing:
            check_chunk(self.path, self.begin, self.end, self.expected, self.algorithm)
            return
        self._sum_to(self.end - self.begin)
        if self.crc != self.expected:
            raise Corrupt(self.path, self.begin, self.end, f"their CRC-32 is {self.crc:08x}, "
                          f"the metadata recorded {self.expected:08x}")


def check_info(path: Path, info: Any, algorithm: str = ALGORITHM) -> None:
    """:func:`check_chunk` of the chunk ``info`` (a ``_StorageInfo``) of ``path``."""
    check_chunk(path, info.offset, info.offset + info.length, getattr(info, ATTR, None),
                algorithm)
