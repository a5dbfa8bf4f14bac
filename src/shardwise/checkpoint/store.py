"""Safe checkpoints on disk: atomic save, checked load, nothing of ours pickled.

Invariants:
- ``save(state, dir)`` writes a DCP checkpoint into ``<dir>.partial``; only after
  every process has written its part (DCP writes the metadata last, then a barrier)
  does process 0 publish it: the previous checkpoint moves to ``<dir>.old``, the new
  one to ``dir``, the old one is removed. A crash at any moment leaves a complete
  checkpoint at ``dir``, or, between the two renames, a complete one at
  ``<dir>.partial`` beside the previous one at ``<dir>.old``.
- Every chunk ``save`` writes carries its CRC-32 in the metadata, and the metadata
  its own and the checksums' algorithm (``integrity``); the directory stays an
  ordinary DCP checkpoint.
- ``load(state, dir)`` loads the checkpoint published at ``dir``. Only when there is
  none does it load the newest complete one beside it (``.partial`` with its
  ``.metadata``, else ``.old``), never silently: a :class:`CheckpointWarning` names
  both and their steps (``fallback="error"`` raises instead). An incomplete
  ``.partial`` is never read.
- ``load`` checks before reading any data: every key of ``state`` is in
  the checkpoint (unless ``strict=False``), shapes and dtypes agree, no target is
  Partial, and every file holds the bytes its metadata promises (a truncated or
  missing file names the key it holds). While reading, each chunk's bytes are summed
  as ``torch.load`` reads them and checked against their CRC-32 before any of its
  values reaches a target (a chunk that fails to deserialise is judged by its bytes
  first), so a damaged file is an error, never a wrong value. Checksums of an
  algorithm this version does not know are an error before any data is read
  (``verify=False`` skips them). Errors are
  :class:`CheckpointError`, naming the key (and, for damage, the file, the byte range
  and the word "corrupt"). Then DCP fills ``state``
  in place, resharding by global offsets.
- Unpickling: the metadata file through an allowlist (DCP's own metadata classes,
  ``torch.Size``, dtypes, paths); non-tensor values with ``weights_only=True``.
  shardwise Tensors are written as their blocks (``shardwise.tensors.chunks``), never
  pickled (``Tensor.__reduce_ex__`` raises).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Literal, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from shardwise.checkpoint import integrity
from shardwise.runtime import world_backend
from shardwise.sharding.errors import ShardingError
from shardwise.tensors.tensor import Tensor

__all__ = ["CheckpointError", "CheckpointWarning", "load", "save"]


class CheckpointError(ShardingError):
    """A checkpoint could not be written or read: missing, truncated, corrupt, or not
    matching the state it is loaded into. The message names the key and the fix."""


class CheckpointWarning(UserWarning):
    """:func:`load` loaded another checkpoint than the one published at its path."""


# --- reading without arbitrary pickles ------------------------------------------------------
_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _DCP_MD: {"Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
              "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata pickle, refusing every class but DCP's own records."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(
            f"The checkpoint metadata asks to load {module}.{name}, which is not one of "
            "DCP's metadata records: refusing to unpickle it (it could run code). Load "
            "only checkpoints you trust, written by torch.distributed.checkpoint."
        )


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader with a safe metadata unpickler, every chunk checked against
    its CRC-32 (``integrity``), and errors that name the key.

    A chunk is read through an ``integrity.SummingView``, which sums its bytes as
    ``torch.load`` reads them (each piece of the data record while the core's cache
    holds it: no second pass over the bytes), and is checked before any of its values
    reaches a target (:class:`_CheckFirst`); a chunk that fails to deserialise is
    judged by its bytes first. Reading a chunk twice (a resharded load) checks it once."""

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True) -> None:
        super().__init__(path)
        self._verify = verify
        self._algorithm = integrity.ALGORITHM  # read_metadata sets the checkpoint's
        self._verified: set[tuple[str, int]] = set()  # (file, offset) checked in this load
        # the chunk being read and its view, until it is checked
        self._current: tuple[tuple[str, int], integrity.SummingView] | None = None
        self._fds: dict[str, int] = {}  # the files being read, by relative path

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        checked = cast(LoadPlanner, _CheckFirst(planner, self._check_current))
        try:
            for item in plan.items:
                self._read_one(plan, checked, item)
        finally:
            self._current = None
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_one(self, plan: LoadPlan, planner: LoadPlanner, item: ReadItem) -> None:
        # one item at a time, so that damaged data names the key it belongs to
        info = self.storage_data[item.storage_index]
        span = (f"{Path(self.path) / info.relative_path} bytes "
                f"{info.offset}..{info.offset + info.length}")
        try:
            try:
                super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
            except Exception:
                self._check_current()  # damaged bytes are the cause: say so
                raise
            self._check_current()
        except CheckpointError:
            raise
        except integrity.Corrupt as err:
            raise CheckpointError(
                f"Key {item.storage_index.fqn!r}: its data in {span} is corrupt "
                f"({err.why}). Restore the checkpoint or load an older one."
            ) from None
        except Exception as err:
            first = (str(err).strip().splitlines() or [""])[0]
            checked = ((info.relative_path, info.offset) in self._verified
                       and getattr(info, integrity.ATTR, None) is not None)
            if not checked and "weights_only" in first:  # torch's advice: not ours
                first = "not a torch.save record that weights_only=True accepts"
            raise CheckpointError(
                f"Key {item.storage_index.fqn!r}: reading its data in {span} failed "
                f"({type(err).__name__}: {first}). "
                + ("Its bytes match their checksum: the value is one that cannot "
                   "be loaded safely." if checked else
                   "The checkpoint is corrupt (or holds a value that cannot be "
                   "loaded safely; no checksum was checked to tell): restore it or "
                   "load an older one.")
            ) from err

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        # the chunk, read with pread from our own descriptor (DCP closes its stream
        # when a read fails; the bytes are judged after that), summed as it is read
        key = (sinfo.relative_path, sinfo.offset)
        path = Path(self.path) / sinfo.relative_path
        if sinfo.relative_path not in self._fds:
            self._fds[sinfo.relative_path] = os.open(path, os.O_RDONLY)
        check = self._verify and key not in self._verified
        view = integrity.SummingView(
            self._fds[sinfo.relative_path], path, sinfo.offset, sinfo.offset + sinfo.length,
            getattr(sinfo, integrity.ATTR, None), self._algorithm, summing=check)
        self._current = (key, view) if check else None
        return cast(IO[bytes], view)

    def _check_current(self) -> None:
        """Check the chunk being read (raises ``integrity.Corrupt``); once per load."""
        current, self._current = self._current, None
        if current is not None:
            current[1].check()
            self._verified.add(current[0])

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(
                f"No checkpoint at {self.path}: {path.name} is missing (an unfinished save "
                "never publishes one). Check the path, or save first."
            ) from None
        data, expected = integrity.split_trailer(raw)
        if expected is not None and integrity.crc32(data) != expected:
            raise CheckpointError(
                f"The checkpoint metadata {path} is corrupt: the CRC-32 of bytes "
                f"0..{len(data)} is {integrity.crc32(data):08x}, its trailer recorded "
                f"{expected:08x}. Restore the checkpoint directory or load an older one."
            )
        f = io.BytesIO(data)
        try:
            md = _MetadataUnpickler(f).load()
            if f.tell() != len(data):
                raise pickle.UnpicklingError(f"{len(data) - f.tell()} bytes after the pickle")
        except CheckpointError:
            raise
        except Exception as err:  # a damaged pickle fails in many ways
            raise CheckpointError(
                f"The checkpoint metadata {path} (bytes 0..{len(raw)}) is truncated or "
                f"corrupt ({type(err).__name__}: {err}). Restore the checkpoint directory or load "
                "an older one."
            ) from err
        if not isinstance(md, Metadata):
            raise CheckpointError(
                f"The checkpoint metadata {path} (bytes 0..{len(raw)}) is corrupt: it holds a "
                f"{type(md).__name__}, not DCP's Metadata. Restore the checkpoint directory."
            )
        # metadata written before the algorithm was recorded holds CRC-32s
        algorithm = getattr(md, integrity.ALGORITHM_ATTR, integrity.ALGORITHM)
        unknown = self._verify and integrity.unknown_algorithm(
            algorithm, f"The checkpoint {self.path}",
            f"metadata attribute {integrity.ALGORITHM_ATTR}", "chunk", "chunks")
        if unknown:
            raise CheckpointError(unknown)
        self._algorithm = algorithm
        meta = getattr(md, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md


class _CheckFirst:
    """A load planner that calls ``check`` before DCP hands it a value to store (a
    tensor to copy into its target, bytes to unpickle): nothing unchecked lands."""

    def __init__(self, planner: LoadPlanner, check: Callable[[], None]) -> None:
        self._planner, self._check = planner, check

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        self._check()
        return self._planner.resolve_tensor(read_item)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self._check()
        self._planner.load_bytes(read_item, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, reading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process call; on a simulated mesh that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# --- save ---------------------------------------------------------------------------------
def _siblings(path: Path) -> tuple[Path, Path]:
    return path.with_name(path.name + ".partial"), path.with_name(path.name + ".old")


def save(state_dict: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``state_dict`` (nested dicts/lists of shardwise Tensors, torch tensors and
    plain values) as a DCP checkpoint at ``path``, atomically: the new checkpoint
    replaces the old one only when every process has finished writing.

    Every process calls it with its own state (SPMD); each writes only the blocks it
    holds, replicas once.

    >>> import tempfile
    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> w = shardwise.tensor(torch.arange(6.), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> shardwise.checkpoint.save({"w": w, "step": 3}, d)
    >>> state = {"w": shardwise.zeros(6), "step": 0}     # any mesh and layout
    >>> shardwise.checkpoint.load(state, d)
    >>> state["w"].tolist(), state["step"]
    ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 3)
    """
    _save(state_dict, path, checksums=True)


def _save(state_dict: Mapping[str, Any], path: str | os.PathLike[str], *,
          checksums: bool) -> None:
    """:func:`save`; ``checksums=False`` writes no checksums (the benchmarks measure
    what they cost: the same path with and without them)."""
    with _told():
        path = Path(path)
        tmp, old = _siblings(path)
        first = world_backend().process_index() == 0
        if first:
            shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save left behind
            tmp.mkdir(parents=True)
        world_backend().barrier("shardwise.checkpoint.save: begin")
        try:
            with _single_process_quiet():
                dcp.save(dict(state_dict), storage_writer=integrity.ChecksummedWriter(
                    tmp, checksums=checksums),
                         no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            cause = _cause(err).rstrip(".")
            raise CheckpointError(
                f"Saving the checkpoint {path} failed: {cause}. The last complete checkpoint "
                f"at {path} is untouched; the unfinished one in {tmp.name} is never read."
            ) from err
        world_backend().barrier("shardwise.checkpoint.save: written")
        if first:
            _publish(tmp, path, old)
        world_backend().barrier("shardwise.checkpoint.save: published")


def _publish(tmp: Path, path: Path, old: Path) -> None:
    """Move the finished ``tmp`` to ``path`` keeping a complete checkpoint at every moment."""
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    _sync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- load ---------------------------------------------------------------------------------
def _step(path: Path) -> int | None:
    """The value saved under the key ``"step"`` in the checkpoint at ``path``, if any
    (``save_train_state`` saves one): it tells two checkpoints apart in messages."""
    with contextlib.suppress(Exception):
        reader = _SafeReader(path)
        md = reader.read_metadata()
        index = next(i for i in md.storage_data if i.fqn == "step")
        info = md.storage_data[index]
        integrity.check_info(path / info.relative_path, info, reader._algorithm)
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            value = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
        return value if isinstance(value, int) else None
    return None


def _described(path: Path) -> str:
    step = _step(path)
    return f"{path}" + ("" if step is None else f" (step {step})")


def _resolve(path: Path, fallback: str) -> Path:
    """``path``, or, when no checkpoint is published there, the newest complete one a
    save left beside it: ``<path>.partial`` when it is complete (its ``.metadata``
    exists: DCP writes it last, once every process has written its data; the save
    stopped before publishing it), else ``<path>.old`` (a save had moved it aside).
    Either is said by a :class:`CheckpointWarning` naming both, or raised with
    ``fallback="error"``."""
    if fallback not in ("warn", "error"):
        raise CheckpointError(
            f"fallback={fallback!r} is not one of 'warn', 'error': with no checkpoint "
            f"published at {path}, 'warn' loads the newest complete one beside it with a "
            "warning, 'error' raises."
        )
    tmp, old = _siblings(path)
    if (path / ".metadata").exists():
        return path
    if (tmp / ".metadata").exists():
        chosen = tmp
        what = (f"No checkpoint is published at {path}, but {_described(tmp)} holds a "
                "complete save that was never published (it stopped after every process "
                "had written, before its rename)")
        if (old / ".metadata").exists():
            what += f"; the checkpoint it replaces is {_described(old)}"
        fix = (f"Move {tmp.name} to {path.name} to publish it"
               + (f" (or {old.name} to go back)" if (old / ".metadata").exists() else ""))
    elif (old / ".metadata").exists():
        chosen = old
        what = (f"No checkpoint is published at {path}: a save moved the previous one, "
                f"{_described(old)}, aside and did not finish"
                + (f" ({tmp} is incomplete)" if tmp.exists() else ""))
        fix = f"Move {old.name} to {path.name} to make it the published checkpoint"
    else:
        return path  # read_metadata says that there is none
    if fallback == "error":
        raise CheckpointError(f"{what}. {fix}, or load with fallback='warn' to load it.")
    warnings.warn(f"{what}: loading {chosen}. {fix}, or pass fallback='error' to raise "
                  "instead.", CheckpointWarning, stacklevel=3)
    return chosen


def load(state_dict: dict[str, Any], path: str | os.PathLike[str], *,
         strict: bool = True, fallback: Literal["warn", "error"] = "warn",
         verify: bool = True) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` (written by
    :func:`save` or ``torch.distributed.checkpoint.save``), resharding each value to
    the target's mesh and layout; non-tensor values are replaced. ``strict=False``
    skips keys the checkpoint lacks. Raises :class:`CheckpointError` naming the key
    for a missing key, a shape or dtype that differs, or a truncated or corrupt file
    (every chunk :func:`save` wrote is checked against its CRC-32).

    When a save was interrupted before publishing, no checkpoint is at ``path``: the
    newest complete one beside it (``<path>.partial``, written but not renamed, else
    ``<path>.old``) is loaded with a :class:`CheckpointWarning` naming both and their
    steps; ``fallback="error"`` raises instead.

    ``verify=False`` skips the chunks' CRC-32s (sizes and the metadata's own checksum
    are still checked).

    >>> import tempfile
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> shardwise.checkpoint.save({"w": torch.ones(2)}, d)
    >>> shardwise.checkpoint.load({"w": torch.zeros(3)}, d)
    Traceback (most recent call last):
    ...
    shardwise.checkpoint.store.CheckpointError: Key 'w': the checkpoint holds shape (2,)
    float32 but the target has shape (3,) float32. ...
    """
    with _told():
        path = _resolve(Path(path), fallback)
        reader = _SafeReader(path, verify=verify)
        md = reader.read_metadata()
        _check(state_dict, md, path, strict)
        try:
            with _single_process_quiet():
                dcp.load(state_dict, storage_reader=reader,
                         planner=_SafeLoadPlanner(allow_partial_load=not strict),
                         no_dist=not dist.is_initialized())
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            raise CheckpointError(f"Loading the checkpoint {path} failed: {_cause(err)}") from err


def _check(state_dict: dict[str, Any], md: Metadata, path: Path, strict: bool) -> None:
    """Every key present, shapes and dtypes equal, files whole: before any data moves."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state_dict)
    saved = md.state_dict_metadata
    wanted: set[str] = set()
    for key, value in flat.items():
        entry = saved.get(key)
        if entry is None:
            if not strict:
                continue
            some = ", ".join(sorted(saved)[:5])
            raise CheckpointError(
                f"Key {key!r} is missing from the checkpoint {path} (it holds {len(saved)} "
                f"keys: {some}{', ...' if len(saved) > 5 else ''}). Load with strict=False "
                "to keep the target's value, or save a state that has it."
            )
        wanted.add(key)
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor != (not isinstance(entry, BytesStorageMetadata)):
            kind = "a tensor" if is_tensor else f"a {type(value).__name__}"
            raise CheckpointError(
                f"Key {key!r}: the target is {kind} but the checkpoint holds "
                f"{'a non-tensor value' if is_tensor else 'a tensor'}. Give the key the "
                "saved kind of value."
            )
        if not is_tensor:
            continue
        shape, dtype = tuple(entry.size), entry.properties.dtype  # type: ignore[union-attr]
        if shape != tuple(value.shape) or dtype != value.dtype:
            raise CheckpointError(
                f"Key {key!r}: the checkpoint holds shape {shape} {_name(dtype)} but the "
                f"target has shape {tuple(value.shape)} {_name(value.dtype)}. Build the "
                "target with the saved shape and dtype, or leave the key out of the state dict."
            )
        if isinstance(value, Tensor) and value.dist_layout.is_partial:
            raise CheckpointError(
                f"Key {key!r}: the target {value!r} is Partial, so its blocks are addends "
                "and cannot be filled with the saved value. Load into a Replicated or "
                "Sharded target (e.g. shardwise.all_reduce(x) first)."
            )
    for index, info in getattr(md, "storage_data", {}).items():
        if index.fqn not in wanted:
            continue
        file = path / info.relative_path
        size = file.stat().st_size if file.exists() else None
        if size is None or size < info.offset + info.length:
            what = "missing" if size is None else f"truncated ({size} bytes)"
            raise CheckpointError(
                f"Key {index.fqn!r}: its data file {file} is {what}; the metadata says "
                f"bytes {info.offset}..{info.offset + info.length}. The checkpoint is "
                "corrupt (incomplete): restore it or load an older one."
            )


@contextlib.contextmanager
def _told() -> Iterator[None]:
    """A :class:`CheckpointError` raised here is recorded as the run's first failure in
    the rendezvous store (bounded), so a peer whose exchange with this process then
    fails can name this rank and the key (see :func:`_cause`)."""
    try:
        yield
    except CheckpointError as err:
        if dist.is_initialized():
            world_backend().record_failure(str(err))
        raise


def _peer(err: BaseException) -> bool:
    """A failure of the exchange between processes (Gloo's own text), not of this one."""
    text = str(err).lower()
    return isinstance(err, dist.DistError) or any(
        w in text for w in ("gloo", "connection closed", "connection reset", "timed out"))


def _cause(err: BaseException) -> str:
    """The root causes of a DCP failure (one per failing process), not its traceback; a
    failed exchange names this rank and the run's first failure (a peer's key)."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict):
        if dist.is_initialized() and _peer(err):
            first = world_backend().first_failure()
            return (f"rank {world_backend().process_index()}'s exchange with the other processes "
                    "failed: a peer failed, died or stalled first ("
                    + (f"the first failure of this run: {first}" if first else
                       "no failure was recorded in the rendezvous store")
                    + f"). Underlying error: {type(err).__name__}: {str(err)[:300]}")
        return f"{type(err).__name__}: {err}"
    return "; ".join(f"process {r}: {_cause(e[0] if isinstance(e, tuple) else e)}"
                     for r, e in sorted(failures.items()))  # (exception, traceback) pairs


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
