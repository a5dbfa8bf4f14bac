"""Pipeline stages: a model cut into stages, each on its slice of the mesh's ``pp`` axis.

``pipeline(model_or_stage_modules, mesh)`` returns a :class:`Pipe`: one :class:`Stage`
per module, in order, each with its ``index``, its ``module`` and its ``mesh`` (the
stage's ``(dp, tp)`` submesh, ``mesh.submesh(pp=rank)``). Users parallelize a stage's
module on the stage's mesh like any module (``parallelize_module``, ``fully_shard``).

Invariants:
- Stage ``s`` lives on pipeline rank ``rank_of(s)``: ``s % p`` (``style="loop"``,
  round-robin over ``stages_per_rank=v`` virtual stages) or the V shape
  (``style="v"``, two stages per rank: ``s`` and ``2p - 1 - s`` on rank ``s``), as
  torch's schedules place them. ``n_stages == p * stages_per_rank``, always.
- A split model's stages share the model's own submodules (nothing is copied): each
  stage is a shallow copy of the root whose top-level children outside the stage are
  ``nn.Identity`` and whose ModuleList/Sequential/ModuleDict children keep only the
  stage's entries. Every parameter belongs to exactly one stage.
- :meth:`Pipe.state_dict` is keyed by the ORIGINAL model's names (``layers.3.w``,
  never a stage's renumbered ``layers.1.w``), so a checkpoint loads on any pp degree.
- A stage is local when this process holds a device of its mesh: all of them on the
  simulated mesh, under torchrun only this rank's. Only local stages are materialized
  (:meth:`Pipe.materialize`) and run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from shardwise.pipelining.slices import restrict_stage
from shardwise.runtime import backend_for
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.mesh import DeviceMesh

__all__ = ["Pipe", "Stage", "pipeline"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(eq=False)
class Stage:
    """One pipeline stage: ``module`` runs on ``mesh`` (its submesh) on pipeline rank
    ``rank``; ``names`` maps the module's own submodule paths to the original model's."""

    index: int
    module: nn.Module
    mesh: DeviceMesh
    rank: int
    names: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def is_local(self) -> bool:
        """Whether this process holds a device of the stage's mesh (runs the stage)."""
        return len(backend_for(self.mesh).owned(self.mesh)) > 0

    def original_name(self, key: str) -> str:
        """A state-dict key of ``module`` -> the original model's key."""
        path, _, leaf = key.rpartition(".")
        head = self.names.get(path, path)
        return f"{head}.{leaf}" if head else leaf


@dataclass(eq=False)
class Pipe:
    """The stages of a pipeline over the ``axis`` of ``mesh`` (see :func:`pipeline`)."""

    stages: list[Stage]
    mesh: DeviceMesh
    axis: str
    style: str
    stages_per_rank: int

    @property
    def pp_size(self) -> int:
        return self.mesh.axis_size(self.axis)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def rank_of(self, stage: int) -> int:
        return self.stages[stage].rank

    @property
    def local_stages(self) -> list[Stage]:
        return [s for s in self.stages if s.is_local]

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of the local stages (one optimizer over all of them works)."""
        for s in self.local_stages:
            yield from s.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The local stages' parameters under the original model's names."""
        for s in self.local_stages:
            for k, p in s.module.named_parameters():
                yield s.original_name(k), p

    def state_dict(self) -> dict[str, Any]:
        """The local stages' state under the ORIGINAL model's keys: save it with
        ``shardwise.checkpoint.save`` and load it (in place) on any pp degree, or into
        the unsplit model's ``state_dict()``."""
        out: dict[str, Any] = {}
        for s in self.local_stages:
            for k, v in s.module.state_dict().items():
                out[s.original_name(k)] = v
        return out

    def materialize(self, init: Callable[[nn.Module], None] | None = None) -> Pipe:
        """Make the local stages' meta-device modules real (``to_empty`` on the stage's
        device), then ``init(module)``, or every submodule's ``reset_parameters()``
        where it has one. Call it after parallelizing (torchtitan's deferred init);
        remote stages stay on meta, so a process builds only its own stages."""
        for s in self.local_stages:
            state = [*s.module.parameters(), *s.module.buffers()]
            if not any(t.is_meta for t in state):
                continue
            backend = backend_for(s.mesh)
            s.module.to_empty(device=backend.device_of(s.mesh, backend.owned(s.mesh)[0]))
            if init is not None:
                init(s.module)
                continue
            with torch.no_grad():
                for m in s.module.modules():
                    reset = getattr(m, "reset_parameters", None)
                    if callable(reset):
                        reset()
        return self

    def __repr__(self) -> str:
        lines = [f"Pipe({self.n_stages} stages on {self.mesh!r}, axis={self.axis!r}, "
                 f"style={self.style!r})"]
        for s in self.stages:
            lines.append(f"  stage {s.index}: rank {s.rank}, {s.mesh!r}, "
                         f"{type(s.module).__name__}")
        return "\n".join(lines)


def pipeline(model_or_stage_modules: nn.Module | Sequence[nn.Module], mesh: DeviceMesh,
             axis: str = "pp", split_points: Sequence[str] | None = None,
             stages_per_rank: int = 1, style: str = "loop") -> Pipe:
    """Cut a model into pipeline stages placed on ``mesh``'s ``axis``.

    Args:
        model_or_stage_modules: a list of modules (the stages, in order), or one model
            with ``split_points``. A model qualifies for splitting when its forward
            applies its top-level children in order, each ModuleList/Sequential/
            ModuleDict child by looping over its entries (torchtitan's models, a GPT
            of embedding, ``layers``, norm, head): a stage is the model with the other
            children replaced by ``nn.Identity`` and the other entries removed, so a
            forward that mixes children (``tok(x) + pos(i)``) must take them as one
            child. The root may hold no parameters of its own.
        mesh: the device mesh; stage ``s`` runs on ``mesh.submesh(axis=rank_of(s))``.
        axis: the pipeline axis of ``mesh``.
        split_points: module names where a stage BEGINS (torch's
            ``SplitPoint.BEGINNING``): top-level children or entries of a top-level
            container (``"layers.2"``), in model order.
        stages_per_rank: virtual stages per pipeline rank (interleaved schedules).
        style: ``"loop"`` (stage ``s`` on rank ``s % p``) or ``"v"`` (ZBV: two stages
            per rank, rank ``r`` holds ``r`` and ``2p - 1 - r``).

    Returns:
        a :class:`Pipe` whose ``stages[i]`` has ``.module``, ``.mesh``, ``.index``.

    >>> mesh = DeviceMesh.cpu((2, 2), ("pp", "tp"))
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> pipe = pipeline(model, mesh, split_points=["2"])
    >>> [(s.index, s.rank, s.mesh) for s in pipe.stages]
    [(0, 0, DeviceMesh(tp=2)), (1, 1, DeviceMesh(tp=2; devices 2..3))]
    >>> sorted(pipe.state_dict())
    ['0.bias', '0.weight', '2.bias', '2.weight']
    """
    if not isinstance(mesh, DeviceMesh):
        raise ShardingTypeError(
            f"pipeline(mesh=...) needs a DeviceMesh. Got {type(mesh).__name__}. Build one "
            "with DeviceMesh.cpu((2, 2, 2), ('pp', 'dp', 'tp')).")
    if axis not in mesh.axis_names:
        raise ShardingError(
            f"pipeline(axis={axis!r}): {mesh!r} has no axis {axis!r}. Name the pipeline "
            f"axis: one of {list(mesh.axis_names)}.")
    if style not in ("loop", "v"):
        raise ShardingError(
            f"pipeline(style={style!r}): use 'loop' (round-robin, GPipe/1F1B/interleaved) "
            "or 'v' (ZBVZeroBubble's V placement).")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or \
            stages_per_rank < 1:
        raise ShardingError(
            f"pipeline(stages_per_rank={stages_per_rank!r}) needs an int >= 1 (the "
            "virtual stages each pipeline rank holds; 2 for interleaved schedules).")
    if style == "v" and stages_per_rank != 2:
        raise ShardingError(
            f"pipeline(style='v') places two stages per rank: pass stages_per_rank=2 (got "
            f"{stages_per_rank}).")
    p = mesh.axis_size(axis)
    if isinstance(model_or_stage_modules, nn.Module):
        if split_points is None:
            modules: list[nn.Module] = [model_or_stage_modules]
            names: list[dict[str, str]] = [{}]
        else:
            modules, names = _split(model_or_stage_modules, list(split_points))
    else:
        modules = list(model_or_stage_modules)
        if split_points is not None:
            raise ShardingError(
                "pipeline(split_points=...) splits one model; a list of modules is already "
                "the stages. Pass either the model with split_points or the stage list.")
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise ShardingTypeError(
                    f"pipeline: stage {i} is a {type(m).__name__}, not an nn.Module. Pass "
                    "a list of modules (the stages in order) or one model.")
        names = [{} for _ in modules]
    n = p * stages_per_rank
    if len(modules) != n:
        raise ShardingError(
            f"pipeline: {len(modules)} stages cannot be placed on {p} pipeline ranks with "
            f"stages_per_rank={stages_per_rank}: the mesh holds p * stages_per_rank = {n} "
            f"stages. Give {n} stages ({n - 1} split points), or set stages_per_rank, or "
            f"build the mesh with {axis}={len(modules) // stages_per_rank or 1}.")
    stages = []
    for s, m in enumerate(modules):
        r = _rank(s, p, style)
        stages.append(Stage(s, m, _stage_mesh(mesh, axis, r), r, names[s]))
    for st in stages:  # parallelized on the whole mesh first: onto each stage's slice
        restrict_stage(st.module, st.mesh, axis, st.index)
    # every process makes every stage's groups now, in one order: then a stage's
    # processes run its ops (parallelize_module, fully_shard, the step) alone
    backend_for(mesh).prepare_stages(mesh, axis, [st.mesh for st in stages])
    return Pipe(stages, mesh, axis, style, stages_per_rank)


def _rank(s: int, p: int, style: str) -> int:
    if style == "v":
        return s if s < p else 2 * p - 1 - s
    return s % p


def _stage_mesh(mesh: DeviceMesh, axis: str, r: int) -> DeviceMesh:
    if mesh.ndim == 1:  # a pp-only mesh: each stage holds one device
        return DeviceMesh((mesh.devices[r],), (1,), (axis,))
    return mesh.submesh(**{axis: r})


def _units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's pipeline units in order: top-level children, containers expanded."""
    out: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, _CONTAINERS):
            out.extend((f"{name}.{k}", m) for k, m in child.named_children())
        else:
            out.append((name, child))
    return out


def _split(model: nn.Module, split_points: list[str]) -> tuple[list[nn.Module],
                                                               list[dict[str, str]]]:
    own = [k for k, _ in model.named_parameters(recurse=False)] + \
        [k for k, _ in model.named_buffers(recurse=False)]
    if own:
        raise ShardingError(
            f"pipeline cannot split {type(model).__name__}: its root holds parameters or "
            f"buffers of its own ({own}), which no stage would own. Move them into a child "
            "module, or pass the stage modules yourself.")
    units = _units(model)
    order = {name: i for i, (name, _) in enumerate(units)}
    top = {name: i for i, (name, _) in enumerate(model.named_children())}
    begins = [0]
    for sp in split_points:
        i = order.get(sp)
        if i is None and sp in top:  # a container's name: it begins at its first entry
            i = next((order[u] for u, _ in units if u.startswith(sp + ".")), None)
        if i is None:
            raise ShardingError(
                f"pipeline: split point {sp!r} is not a module of {type(model).__name__} "
                f"that a stage can begin at. Use a top-level child or an entry of a "
                f"top-level ModuleList/Sequential/ModuleDict: {[u for u, _ in units]}.")
        if i <= begins[-1]:
            raise ShardingError(
                f"pipeline: split points {split_points} must name modules in model order, "
                f"each after the previous one (and not the first module, {units[0][0]!r}): "
                f"{sp!r} would leave a stage empty.")
        begins.append(i)
    ends = [*begins[1:], len(units)]
    name_of = {id(m): k for k, m in model.named_modules()}
    modules, names = [], []
    for b, e in zip(begins, ends, strict=True):
        keep = {u for u, _ in units[b:e]}
        stage = _stage_of(model, keep)
        modules.append(stage)
        names.append({k: name_of[id(m)] for k, m in stage.named_modules()
                      if k and id(m) in name_of})
    return modules, names


def _stage_of(model: nn.Module, keep: set[str]) -> nn.Module:
    """A shallow copy of ``model`` holding only the units in ``keep`` (shared, not
    copied); the other top-level children become Identity or leave their container."""
    stage = copy.copy(model)
    for k, v in model.__dict__.items():  # own hook tables: fully_shard hooks one stage
        if k.startswith("_") and isinstance(v, (dict, set)):
            stage.__dict__[k] = copy.copy(v)
    stage._modules = {}
    for name, child in model.named_children():
        if isinstance(child, _CONTAINERS):
            kept = [(k, m) for k, m in child.named_children() if f"{name}.{k}" in keep]
            box: nn.Module
            if isinstance(child, nn.ModuleList):
                box = nn.ModuleList(m for _, m in kept)
            elif isinstance(child, nn.ModuleDict):
                box = nn.ModuleDict(dict(kept))
            else:
                box = nn.Sequential()
                for k, m in kept:
                    box.add_module(k, m)
            stage._modules[name] = box
        else:
            stage._modules[name] = child if name in keep else nn.Identity()
    return stage
