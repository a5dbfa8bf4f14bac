"""The replica check: every device that holds a copy of a replicated value (a parameter
Replicated on some mesh axis, a plain input a parallel style places) holds the same
bytes. Replicas that drift apart (ranks fed different batches, seeded differently, a
rank-dependent update) train a wrong model without any error; this check names the
rank whose copy differs.

Invariants:
- Off by default, and then nothing is installed: no optimizer hook, no input record
  (``ENABLED`` is None; the styles' forward hooks read it once per module call).
- On (``initialize(check_replicas=N)`` or ``SHARDWISE_CHECK_REPLICAS=N``), a *step* is
  one optimizer step: torch.optim's global post-step hook counts every ``step()`` of
  every optimizer, and each N-th one checks that optimizer's parameters and the plain
  tensor inputs the parallel styles placed since the last check.
- One check is one all_gather over the world of one int64 per value (a CRC-32 of this
  process's block; on the simulated runtime, of every device's block, no collective):
  every rank reads the same table and raises the same :class:`CollectiveError`.
- Within each group of devices that must hold the same block (``Layout.representatives``;
  a plain input: every device of its mesh), the most common hash wins when more than
  half hold it and the others are named; with no majority (two ranks) all are named.
"""

from __future__ import annotations

import weakref
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn

from shardwise.runtime import backend_for, holds_whole, world_backend
from shardwise.sharding.errors import CollectiveError, ShardingTypeError
from shardwise.sharding.mesh import DeviceMesh
from shardwise.tensors.tensor import Tensor

__all__ = ["ENABLED", "check_every", "check_replicas", "disable", "enable", "record_inputs",
           "track"]


class _State:
    """The check's settings and what it has seen (one per process)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.steps = 0
        self.inputs: dict[str, tuple[DeviceMesh, torch.Tensor]] = {}
        self.handle: Any = None


ENABLED: _State | None = None
"""The running check (None: off, and nothing is installed)."""

_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # parallelized modules, for names


def track(module: nn.Module) -> None:
    """Remember a parallelized module, so that the check names its parameters."""
    _MODELS.add(module)


def check_every(every: Any) -> int:
    """``every`` when it is a number of optimizer steps (an int >= 0), else an error."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ShardingTypeError(
            f"check_replicas takes a number of optimizer steps (an int >= 0; 0 is off). "
            f"Got {every!r}; e.g. check_replicas=100 checks every 100th step.")
    return every


def enable(every: int) -> None:
    """Check replicas every ``every`` optimizer steps (0: off, the hook removed)."""
    global ENABLED
    check_every(every)
    disable()
    if every == 0:
        return
    state = _State(every)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    state.handle = register_optimizer_step_post_hook(_after_step)
    ENABLED = state


def disable() -> None:
    global ENABLED
    if ENABLED is not None and ENABLED.handle is not None:
        ENABLED.handle.remove()
    ENABLED = None


def record_inputs(name: str, mesh: DeviceMesh, args: tuple[Any, ...]) -> None:
    """A parallelized module's plain tensor inputs (global values, which every rank must
    hold alike), kept until the next check (only while the check is on)."""
    state = ENABLED
    if state is None:
        return
    for i, x in enumerate(args):
        if isinstance(x, torch.Tensor) and not isinstance(x, Tensor):
            state.inputs[f"input {i} of {name or 'the model'}"] = (mesh, x.detach())


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    state = ENABLED
    if state is None:
        return
    state.steps += 1
    if state.steps % state.every:
        return
    names = _names()
    items: list[tuple[str, Any]] = [
        (names.get(id(p), f"param_groups[{g}][{i}]"), p)
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"]) if isinstance(p, Tensor)]
    items += [(name, mx) for name, mx in sorted(state.inputs.items())]
    state.inputs.clear()
    _check(items, state.steps)


def _names() -> dict[int, str]:
    """id(parameter) -> its name in the outermost tracked module that holds it."""
    out: dict[int, str] = {}
    for module in list(_MODELS):
        for name, p in module.named_parameters(remove_duplicate=False):
            if len(name) > len(out.get(id(p), "")):
                out[id(p)] = name
    return out


def check_replicas(values: nn.Module | torch.Tensor | Mapping[str, torch.Tensor]
                   | Iterable[torch.Tensor], *, step: int | None = None) -> None:
    """Check once that every replica of ``values`` (a module's parameters and buffers,
    a tensor, a dict of name -> tensor, or a list) holds the same bytes on every
    device; raises :class:`CollectiveError` naming the value, the device (rank) whose
    copy differs and ``step`` otherwise. Collective on the multi-process runtime: every
    rank must call it with the same values.

    On ``DeviceMesh.cpu(2, "tp")`` a Replicated bias has one block per device::

        device   0          1
        bias     b          b       (equal: passes)

    >>> mesh = DeviceMesh.cpu(2, "tp")
    >>> b = shardwise.tensor(torch.ones(3), sharding=PlacementMapping(mesh, [Replicated()]))
    >>> check_replicas({"bias": b})
    >>> bad = Tensor([torch.ones(3), torch.zeros(3)], b.dist_layout, (3,), torch.float32)
    >>> check_replicas({"bias": bad}, step=7)   # device 1 wrote its copy alone
    Traceback (most recent call last):
    ...
    shardwise.sharding.errors.CollectiveError: Replica check at step 7: bias (Replicated ...
    """
    items: list[tuple[str, Any]]
    if isinstance(values, nn.Module):
        items = [(n, t) for n, t in [*values.named_parameters(), *values.named_buffers()]
                 if isinstance(t, Tensor)]
    elif isinstance(values, torch.Tensor):
        items = [("the tensor", values)]
    elif isinstance(values, Mapping):
        items = [(str(k), v) for k, v in values.items()]
    elif isinstance(values, Iterable):
        items = [(f"[{i}]", v) for i, v in enumerate(values)]
    else:
        raise ShardingTypeError(
            "check_replicas takes a module, a tensor, a dict of name -> tensor or a list of "
            f"tensors. Got {type(values).__name__}.")
    for name, v in items:
        if not isinstance(v, Tensor):
            raise ShardingTypeError(
                f"check_replicas: {name} is a {type(v).__name__}, not a shardwise Tensor; "
                "place it first (shardwise.tensor(x, sharding=...)).")
    _check(items, step)


def _groups(name: str, item: Any) -> tuple[str, DeviceMesh, list[list[int]],
                                          list[torch.Tensor | None]]:
    """A checked value in words, its mesh, its groups of devices that must hold equal
    blocks (two or more) and its blocks (None where this process holds none)."""
    if isinstance(item, Tensor):
        layout = item.dist_layout
        reps = layout.representatives()
        mesh = item.mesh
        axes = [mesh.axis_names[a] for a in layout.replicated_axes()]
        what = f"{name} (Replicated over mesh axes {axes} of {mesh!r})"
        blocks: list[torch.Tensor | None] = list(item.shards)
    else:  # (mesh, a plain tensor): the global value every device's process holds
        mesh, x = item
        what = f"{name} (a plain tensor: the same global value on every device of {mesh!r})"
        reps = (0,) * mesh.num_devices
        owned = set(backend_for(mesh).owned(mesh))
        blocks = [x if k in owned else None for k in range(mesh.num_devices)]
    by: dict[int, list[int]] = {}
    for k, r in enumerate(reps):
        by.setdefault(r, []).append(k)
    return what, mesh, [g for g in by.values() if len(g) > 1], blocks


def _crc(block: torch.Tensor) -> int:
    b = block.detach()
    if b.device.type != "cpu":
        b = b.cpu()
    b = b.contiguous().reshape(-1)
    if b.dtype is torch.bool:
        b = b.to(torch.uint8)
    return zlib.crc32(b.view(torch.uint8).numpy().data)  # no copy


def _check(items: list[tuple[str, Any]], step: int | None) -> None:
    found = [_groups(name, item) for name, item in items]
    checked = [f for f in found if f[2]]
    if not checked:
        return
    # table[i][k]: the hash of value i's block on device k (this process's devices)
    table: list[dict[int, int]] = [
        {k: _crc(b) for k, b in enumerate(blocks) if b is not None}
        for _, _, _, blocks in checked]
    multi = any(not holds_whole(mesh) for _, mesh, _, _ in checked)
    if multi:
        table = _exchange(checked, table)
    problems = []
    for (name, mesh, groups, _), hashes in zip(checked, table):
        for g in groups:
            said = _verdict(name, mesh, g, hashes, multi)
            if said:
                problems.append(said)
    if problems:
        at = f" at step {step}" if step is not None else ""
        raise CollectiveError(
            f"Replica check{at}: " + " ".join(problems) + " Replicated values must be "
            "equal on every device that holds them; copies drift apart when ranks get "
            "different inputs or seeds for a replicated value, or code updates one rank's "
            "copy alone. Give every rank the same inputs and seed (shard the batch over "
            "the data-parallel axis instead of feeding ranks different data), and look "
            "for rank-dependent code before this step.")



def _exchange(checked: list[Any], table: list[dict[int, int]]) -> list[dict[int, int]]:
    """Every rank's hash of every value, by device: one all_gather over the world."""
    mine = torch.tensor([next(iter(h.values()), -1) for h in table], dtype=torch.int64)
    rows = world_backend().gather_world(mine, "replica check").tolist()
    return [{k: rows[d.id][i] for k, d in enumerate(mesh.devices)}
            for i, (_, mesh, _, _) in enumerate(checked)]


def _verdict(name: str, mesh: DeviceMesh, group: list[int], hashes: dict[int, int],
             multi: bool) -> str:
    """'' when the group's copies agree, else a sentence naming who differs."""
    who = "rank" if multi else "device"
    seen = {k: hashes[k] for k in group if k in hashes}
    counts = Counter(seen.values())
    if len(counts) <= 1:
        return ""
    ids = {k: mesh.devices[k].id for k in group}
    top, n = counts.most_common(1)[0]
    if 2 * n > len(seen):
        odd = sorted(ids[k] for k, h in seen.items() if h != top)
        good = sorted(ids[k] for k, h in seen.items() if h == top)
        return (f"{name}: {_list(who, odd)}'s cop{'ies differ' if len(odd) > 1 else 'y differs'}"
                f" from the majority ({_list(who, good)}).")
    return (f"{name}: {_list(who, sorted(ids.values()))} hold different copies, with no "
            "majority (any of them may be the wrong one).")


def _list(who: str, ids: list[int]) -> str:
    if len(ids) == 1:
        return f"{who} {ids[0]}"
    return f"{who}s {', '.join(map(str, ids[:-1]))} and {ids[-1]}"
