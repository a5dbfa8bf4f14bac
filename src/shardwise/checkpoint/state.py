"""Model and optimizer state of a shardwise-parallel run: save, resume on another mesh.

Invariants:
- ``get_state_dict``/``set_state_dict`` are torch's own
  (``torch.distributed.checkpoint.state_dict``): they work unchanged on modules whose
  parameters are shardwise Tensors, and the optimizer state they return has each
  parameter's layout (``torch.optim`` makes it with ``zeros_like(p)``).
- ``save_train_state``/``load_train_state`` go through :mod:`shardwise.checkpoint.store`
  (atomic, checked): loading fills the *current* model's and optimizer's tensors in
  place, so a run saved on one mesh resumes on another with the same values.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from shardwise.checkpoint.store import load, save
from shardwise.tensors.tensor import Tensor

__all__ = ["StateDictOptions", "full_state_dict", "get_state_dict", "load_train_state",
           "save_train_state", "set_state_dict"]


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every shardwise Tensor gathered to a plain torch tensor
    of its global value (every rank calls it: under torchrun it is a collective), for
    writers that read raw bytes, such as transformers' ``save_pretrained`` (safetensors
    reads ``data_ptr()``, which a distributed value does not have)::

        model.save_pretrained(d, state_dict=full_state_dict(model),
                              is_main_process=dist.get_rank() == 0)

    Tied parameters stay one tensor (transformers drops the tied copy by identity).

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> model = torch.nn.Linear(4, 6)
    >>> model.weight = torch.nn.Parameter(shardwise.tensor(
    ...     model.weight.detach(), sharding=PlacementMapping(mesh, [Sharded(0)])))
    >>> sd = shardwise.checkpoint.full_state_dict(model)
    >>> type(sd["weight"]) is torch.Tensor, tuple(sd["weight"].shape)
    (True, (6, 4))
    """
    done: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict().items():
        if isinstance(value, Tensor):
            if id(value) not in done:
                done[id(value)] = value.detach().to_torch()
            value = done[id(value)]
        out[name] = value
    return out


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
