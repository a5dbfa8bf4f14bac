"""Checkpoints of shardwise Tensors: DCP-native, safetensors, DTensor interop.

- ``torch.distributed.checkpoint`` (``dcp.save``/``dcp.load``/``dcp.async_save``)
  takes shardwise Tensors directly: each is written as its blocks with global
  offsets and loaded in place, resharded to the target's mesh and layout.
- :func:`save`/:func:`load`: the same on disk, atomic and checked (no half-written
  checkpoint replaces a good one; every chunk carries a CRC-32, so damage and
  mismatches raise :class:`CheckpointError` naming the key; loading another checkpoint
  than the published one warns, :class:`CheckpointWarning`; nothing of ours is pickled).
- :func:`full_state_dict`: plain torch tensors of the global values, for writers of raw
  bytes (transformers' ``save_pretrained(d, state_dict=full_state_dict(model))``).
- :func:`get_state_dict`/:func:`set_state_dict` (torch's own) and
  :func:`save_train_state`/:func:`load_train_state` for model + optimizer.
- :func:`save_safetensors`/:func:`load_safetensors`: one consolidated file of global
  tensors, written by offsets and read by slices.
- :func:`to_dtensor`/:func:`from_dtensor`: DTensor interop on process meshes.
"""

from __future__ import annotations

from shardwise.checkpoint.dtensor import from_dtensor, to_dtensor
from shardwise.checkpoint.safetensors_io import load_safetensors, save_safetensors
from shardwise.checkpoint.state import (
    StateDictOptions,
    full_state_dict,
    get_state_dict,
    load_train_state,
    save_train_state,
    set_state_dict,
)
from shardwise.checkpoint.store import CheckpointError, CheckpointWarning, load, save

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "StateDictOptions",
    "from_dtensor",
    "full_state_dict",
    "get_state_dict",
    "load",
    "load_safetensors",
    "load_train_state",
    "save",
    "save_safetensors",
    "save_train_state",
    "set_state_dict",
    "to_dtensor",
]
