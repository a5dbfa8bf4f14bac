"""Model and optimizer state of a shardwise-parallel run: save, resume on another mesh.

Invariants:
- ``get_state_dict``/``set_state_dict`` are torch's own
  (``torch.distributed.checkpoint.state_dict``): they work unchanged on modules whose
  parameters are shardwise Tensors, and the optimizer state they return has each
  parameter's layout (``torch.optim`` makes it with ``zeros_like(p)``).
- ``save_train_state``/``load_train_state`` go through :mod:`shardwise.checkpoint.store`
  (atomic, checked): loading fills the *current* model's and optimizer's tensors in
  place, so a run saved on one mesh resumes on another with the same values.
- ``full_state_dict``/``gather_values`` turn each shardwise Tensor into a plain tensor of
  its global value (every process gathers every one, so their collectives agree); names
  that hold the same data (tied weights, which ``state_dict()`` detaches name by name)
  get one tensor, as torch's own state dict gives them one storage.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from shardwise.checkpoint.store import load, save
from shardwise.tensors.tensor import Tensor

__all__ = ["StateDictOptions", "full_state_dict", "gather_values", "get_state_dict",
           "load_train_state", "save_train_state", "set_state_dict"]


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every shardwise Tensor gathered to a plain torch tensor
    of its global value (every rank calls it: under torchrun it is a collective), for
    writers that read raw bytes, such as transformers' ``save_pretrained`` (safetensors
    reads ``data_ptr()``, which a distributed value does not have)::

        model.save_pretrained(d, state_dict=full_state_dict(model),
                              is_main_process=dist.get_rank() == 0)

    Tied parameters stay one tensor (transformers drops the tied copy by its storage).
    transformers models that ``parallelize_module``/``fully_shard`` laid out call this
    themselves in ``save_pretrained`` (see :func:`shardwise.parallel.hf.gather_on_save`).

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> model = torch.nn.Linear(4, 6)
    >>> model.weight = torch.nn.Parameter(shardwise.tensor(
    ...     model.weight.detach(), sharding=PlacementMapping(mesh, [Sharded(0)])))
    >>> sd = shardwise.checkpoint.full_state_dict(model)
    >>> type(sd["weight"]) is torch.Tensor, tuple(sd["weight"].shape)
    (True, (6, 4))
    """
    return gather_values(module.state_dict())


def gather_values(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every shardwise Tensor replaced by a plain torch tensor of its
    global value (detached); other values as they are. Every rank calls it (a collective
    under torchrun): each shardwise Tensor is gathered, in ``state``'s order, so every
    process runs the same collectives whatever it holds. Names holding the same data
    (tied weights) then share one tensor, so writers that deduplicate by storage see
    them tied.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> w = shardwise.tensor(torch.ones(4, 2), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> out = gather_values({"a": w.detach(), "b": w.detach(), "step": 3})
    >>> out["a"] is out["b"], type(out["a"]) is torch.Tensor, out["step"]
    (True, True, 3)
    """
    done: dict[Hashable, torch.Tensor] = {}
    out: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, Tensor):
            gathered = value.detach().to_torch()
            key = _data_key(value)
            first = done.setdefault(key, gathered) if key is not None else gathered
            # the same local blocks, and (what this process cannot see of the others'
            # blocks) the same global value: one tensor
            value = first if torch.equal(first, gathered) else gathered
        out[name] = value
    return out


def _data_key(t: Tensor) -> Hashable | None:
    """Equal for two Tensors whose local blocks are the same memory, laid out alike
    (``state_dict()`` detaches each tied name into its own wrapper over the same
    blocks); None where that cannot tell (no block here, or an empty one: empty
    blocks of different Tensors may share an address)."""
    blocks = tuple((s.untyped_storage().data_ptr(), s.storage_offset(), s.stride(), s.shape)
                   for s in t.addressable_shards.values())
    if not blocks or any(0 in shape for *_, shape in blocks):
        return None
    return (t.dist_layout, t.shape, t.dtype, blocks)


def _optimizers(optimizers: Any) -> tuple[torch.optim.Optimizer, ...]:
    return (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(
        optimizers)


def save_train_state(path: str | os.PathLike[str], model: torch.nn.Module,
                     optimizers: Any, *, step: int, extra: dict[str, Any] | None = None
                     ) -> None:
    """Save ``model``, ``optimizers`` and the step counter at ``path`` (atomically).

    >>> import tempfile
    >>> mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    >>> model = torch.nn.Linear(4, 6)
    >>> model.weight = torch.nn.Parameter(shardwise.tensor(
    ...     model.weight.detach(), sharding=PlacementMapping(mesh, [Replicated(), Sharded(0)])))
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> d = tempfile.mkdtemp() + "/run"
    >>> shardwise.checkpoint.save_train_state(d, model, opt, step=7)
    >>> shardwise.checkpoint.load_train_state(d, model, opt)
    7
    """
    msd, osd = get_state_dict(model, _optimizers(optimizers))
    save({"model": msd, "optim": osd, "step": step, "extra": dict(extra or {})}, path)


def load_train_state(path: str | os.PathLike[str], model: torch.nn.Module, optimizers: Any,
                     *, extra: dict[str, Any] | None = None,
                     fallback: Literal["warn", "error"] = "warn") -> int:
    """Fill ``model`` and ``optimizers`` (built on any mesh and layout) from ``path``
    and return the saved step; ``extra`` (if given) receives the saved extras in place.
    ``fallback`` is :func:`shardwise.checkpoint.load`'s (an interrupted save)."""
    optims = _optimizers(optimizers)
    msd, osd = get_state_dict(model, optims)
    state: dict[str, Any] = {"model": msd, "optim": osd, "step": 0,
                             "extra": extra if extra is not None else {}}
    load(state, path, fallback=fallback)
    set_state_dict(model, optims, model_state_dict=msd, optim_state_dict=osd)
    return int(state["step"])
