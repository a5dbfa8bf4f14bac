"""Safe checkpoints on disk: atomic save, checked load, nothing of ours pickled.

Invariants:
- ``save(state, dir)`` writes a DCP checkpoint into ``<dir>.partial``; only after
  every process has written its part (DCP writes the metadata last, then a barrier)
  does process 0 publish it: the previous checkpoint moves to ``<dir>.old``, the new
  one to ``dir``, the old one is removed. A crash at any moment leaves a complete
  checkpoint at ``dir``, or, between the two renames, at ``<dir>.old``, which
  ``load`` falls back to. A ``.partial`` directory is never read.
- ``load(state, dir)`` checks before reading any data: every key of ``state`` is in
  the checkpoint (unless ``strict=False``), shapes and dtypes agree, no target is
  Partial, and every file holds the bytes its metadata promises (a truncated or
  missing file names the key it holds). Errors are :class:`CheckpointError`, naming
  the key. Then DCP fills ``state`` in place, resharding by global offsets.
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
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from shardwise.api import distributed
from shardwise.sharding.errors import ShardingError
from shardwise.tensors.tensor import Tensor

__all__ = ["CheckpointError", "load", "save"]


class CheckpointError(ShardingError):
    """A checkpoint could not be written or read: missing, truncated, or not matching
    the state it is loaded into. The message names the key and the fix."""


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
    """DCP's file reader with a safe metadata unpickler and errors that name the key."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # one item at a time, so that damaged data names the key it belongs to
        for item in plan.items:
            try:
                super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
            except CheckpointError:
                raise
            except Exception as err:
                first = (str(err).strip().splitlines() or [""])[0]
                raise CheckpointError(
                    f"Key {item.storage_index.fqn!r}: reading its data from {self.path} "
                    f"failed ({type(err).__name__}: {first}). The checkpoint is damaged: "
                    "restore it or load an older one."
                ) from err
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(
                f"No checkpoint at {self.path}: {path.name} is missing (an unfinished save "
                "never publishes one). Check the path, or save first."
            ) from None
        except (EOFError, pickle.UnpicklingError) as err:
            raise CheckpointError(
                f"The checkpoint metadata {path} is truncated or corrupt ({err}). Restore "
                "the checkpoint directory or load an older one."
            ) from err
        if getattr(md, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


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
    with _told():
        path = Path(path)
        tmp, old = _siblings(path)
        first = distributed.process_index() == 0
        if first:
            shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save left behind
            tmp.mkdir(parents=True)
        distributed.barrier("shardwise.checkpoint.save: begin")
        try:
            with _single_process_quiet():
                dcp.save(dict(state_dict), storage_writer=dcp.FileSystemWriter(tmp),
                         no_dist=not distributed.is_initialized())
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            cause = _cause(err).rstrip(".")
            raise CheckpointError(
                f"Saving the checkpoint {path} failed: {cause}. The last complete checkpoint "
                f"at {path} is untouched; the unfinished one in {tmp.name} is never read."
            ) from err
        distributed.barrier("shardwise.checkpoint.save: written")
        if first:
            _publish(tmp, path, old)
        distributed.barrier("shardwise.checkpoint.save: published")


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
def _resolve(path: Path) -> Path:
    """``path``, or the previous checkpoint a save in progress had moved aside."""
    old = _siblings(path)[1]
    if not (path / ".metadata").exists() and (old / ".metadata").exists():
        return old
    return path


def load(state_dict: dict[str, Any], path: str | os.PathLike[str], *,
         strict: bool = True) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` (written by
    :func:`save` or ``torch.distributed.checkpoint.save``), resharding each value to
    the target's mesh and layout; non-tensor values are replaced. ``strict=False``
    skips keys the checkpoint lacks. Raises :class:`CheckpointError` naming the key
    for a missing key, a shape or dtype that differs, or a truncated file.

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
        path = _resolve(Path(path))
        reader = _SafeReader(path)
        md = reader.read_metadata()
        _check(state_dict, md, path, strict)
        try:
            with _single_process_quiet():
                dcp.load(state_dict, storage_reader=reader,
                         planner=_SafeLoadPlanner(allow_partial_load=not strict),
                         no_dist=not distributed.is_initialized())
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
                "incomplete: restore it or load an older one."
            )


@contextlib.contextmanager
def _told() -> Iterator[None]:
    """A :class:`CheckpointError` raised here is recorded as the run's first failure in
    the rendezvous store (bounded), so a peer whose exchange with this process then
    fails can name this rank and the key (see :func:`_cause`)."""
    try:
        yield
    except CheckpointError as err:
        if distributed.is_initialized():
            from shardwise.runtime.process import diagnose

            diagnose.record(str(err))
        raise


def _peer(err: BaseException) -> bool:
    """A failure of the exchange between processes (Gloo's own text), not of this one."""
    import torch.distributed as dist

    text = str(err).lower()
    return isinstance(err, dist.DistError) or any(
        w in text for w in ("gloo", "connection closed", "connection reset", "timed out"))


def _cause(err: BaseException) -> str:
    """The root causes of a DCP failure (one per failing process), not its traceback; a
    failed exchange names this rank and the run's first failure (a peer's key)."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict):
        if distributed.is_initialized() and _peer(err):
            from shardwise.runtime.process import diagnose

            first = diagnose.first_failure()
            return (f"rank {distributed.process_index()}'s exchange with the other processes "
                    "failed: a peer failed, died or stalled first ("
                    + (f"the first failure of this run: {first}" if first else
                       "no failure was recorded in the rendezvous store")
                    + f"). Underlying error: {type(err).__name__}: {str(err)[:300]}")
        return f"{type(err).__name__}: {err}"
    return "; ".join(f"process {r}: {_cause(e[0] if isinstance(e, tuple) else e)}"
                     for r, e in sorted(failures.items()))  # (exception, traceback) pairs


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
