"""Runtime backends: where a Tensor's shards live and how plan steps execute.

One protocol (:class:`Backend`, shard_map's SPMD bodies included: ``run_spmd`` and
``spmd_outputs``), two backends in their own subpackages: ``simulated/`` (every device
of the mesh in this process) and ``process/`` (one process per device,
torch.distributed). Ops pick the backend from the mesh (:func:`backend_for`). Shared
by both, on this floor: ``blocks`` (block recipes), ``buffers`` (large result
buffers), ``spmd`` (the axis environment of a running shard_map body), ``observe``
(observers of collectives).

Invariants:
- A multi-device mesh is never simulated in a process that torchrun launched as
  one of several (``WORLD_SIZE`` > 1) before ``initialize()``: that is an error
  naming the fix, not every process silently doing all the work.
- A reduction the dtype cannot do fails here, before any collective, with the
  same ``ShardingTypeError`` on both runtimes and every mesh size.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch
import torch.distributed as dist

from shardwise.planner import Plan, Step
from shardwise.runtime.owner import GradOwner
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp

if TYPE_CHECKING:
    from shardwise.propagation.binding import Factors
    from shardwise.propagation.decide import Decision

__all__ = ["Backend", "Decided", "GradOwner", "SpmdOutputs", "backend_for", "check_reduce",
           "world_started"]


class Decided(Protocol):
    """A decided op (the decision cache's value, ``tensors.cache.Decided``): its rule
    bound to shapes, its decision, and its operands in the layouts the decision
    requires, as a runtime running the op asks for them."""

    dec: Decision
    factors: Factors

    def blocks(self, args: Sequence[Any]) -> Sequence[Sequence[torch.Tensor | None] | None]:
        """Per operand its blocks (None for a constant)."""
        ...

    def wholes(self, args: Sequence[Any], views: dict[int, torch.Tensor] | None
               ) -> list[Any] | None:
        """Per operand its whole value (a constant as it is), or None where some
        operand has none."""
        ...

    def aliases_copy(self, args: Sequence[Any], result: torch.Tensor) -> bool:
        """Whether a result of the wholes aliases a copy made of some operand's blocks
        (it must then alias the blocks: the op reruns on them)."""
        ...

_dist_available = dist.is_available()


class Backend(Protocol):
    """What a runtime provides. ``shards`` is one entry per mesh device (row-major);
    a backend may hold ``None`` for devices this process cannot address."""

    def execute_plan(self, plan: Plan, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...

    def run_local(self, op: str, fn: Callable[..., torch.Tensor], args: Sequence[Any],
                  decided: Decided, shaped: bool, views: dict[int, torch.Tensor] | None
                  ) -> tuple[Any, torch.Tensor | None]:
        """Run a decided op's local computation ``fn`` where this runtime runs it: once
        on the operands' whole values when it holds them (the simulated mesh), else
        once per distinct row of blocks (``decided`` gives the operands ``args`` in
        their required layouts, constants as they are; ``shaped``: ``fn`` also takes
        the expected output shape; ``views``: see ``Decided.wholes``). Returns what
        this process holds of the result (a :class:`~shardwise.runtime.local.Local`,
        laid out as ``decided.dec.output``) and one torch tensor of it (None when it
        holds none)."""
        ...

    def run_step(self, step: Step, shards: Sequence[torch.Tensor],
                 shape: tuple[int, ...]) -> list[torch.Tensor]: ...

    def assemble(self, shards: Sequence[torch.Tensor], src: Layout, dst: Layout,
                 shape: tuple[int, ...]) -> list[torch.Tensor]: ...

    def make_partial(self, shards: Sequence[torch.Tensor], layout: Layout,
                     axes: tuple[int, ...], op: ReduceOp) -> list[torch.Tensor]: ...

    def relabel(self, shards: Sequence[torch.Tensor], layout: Layout,
                axes: tuple[int, ...], op: ReduceOp) -> list[torch.Tensor]: ...

    def diverge(self, shards: Sequence[torch.Tensor], layout: Layout,
                axes: tuple[int, ...], owner: GradOwner | None = None) -> list[torch.Tensor]:
        """Identity forward; backward sums the devices' gradient shares over ``axes``,
        less the axes ``owner`` (the value's :class:`GradOwner`) sums itself."""
        ...

    def permute(self, shards: Sequence[torch.Tensor], layout: Layout,
                source: Sequence[int | None], shape: tuple[int, ...]) -> list[torch.Tensor]: ...

    def global_value(self, shards: Sequence[torch.Tensor], layout: Layout,
                     shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def device_of(self, mesh: DeviceMesh, k: int) -> torch.device: ...

    def owned(self, mesh: DeviceMesh) -> Sequence[int]: ...

    def run_spmd(self, fn: Callable[..., Any], mesh: DeviceMesh,
                 inputs: Sequence[tuple[Sequence[torch.Tensor | None], Layout]],
                 timeout_s: float) -> tuple[list[Any], int | None]:
        """Run a shard_map body once per device this process holds, on that device's
        block of each input, with the ``lax`` collectives in scope; returns the
        per-device outputs (None where another process holds the device) and this
        process's device index (None when this process holds every device)."""
        ...

    def spmd_outputs(self, mesh: DeviceMesh, index: int | None,
                     blocks: Sequence[Sequence[torch.Tensor | None]],
                     layouts: Sequence[Layout], check: bool) -> SpmdOutputs:
        """shard_map's outputs from ``run_spmd``'s blocks (``blocks[j][k]``: output
        ``j`` of device ``k``, None where another process holds it), one layout each.
        Returns per output: every device's (block shape, dtype) or None when not
        needed (no sharded dim and no check: this process's block gives the shape);
        the shards of the output (replicas share coordinate 0's block, a replica off
        coordinate 0 gets no gradient); and, when ``check``, None or the devices
        ``(k, r)`` whose blocks differ where the layout replicates them (``()``:
        some, unnamed)."""
        ...


SpmdOutputs: TypeAlias = tuple[
    list[list[tuple[tuple[int, ...], torch.dtype]] | None],  # block shapes and dtypes
    list[list[torch.Tensor | None]],                         # the outputs' shards
    list[tuple[int, ...] | None],                            # replicas that differ
]
"""What :meth:`Backend.spmd_outputs` returns, one entry per output in each list."""


_LOADED: dict[str, Any] = {}


def _module(name: str) -> Any:
    # Imported on first use (the process backend pulls in torch.distributed's
    # collectives; the simulated one is imported by most programs anyway), then one
    # dict lookup per op.
    mod = _LOADED.get(name)
    if mod is None:
        mod = _LOADED[name] = importlib.import_module(f"shardwise.runtime.{name}")
    return mod


def backend_for(mesh: DeviceMesh) -> Backend:
    """The backend that executes ops on ``mesh``: the torch.distributed backend when
    the mesh's devices are processes of an initialized world, else the simulated one.

    Under torchrun (``WORLD_SIZE`` > 1) without ``initialize()``, a mesh of several
    devices raises instead of being simulated whole in every process.
    """
    # Fast path first: this runs on every op, and most programs never initialize.
    if not (_dist_available and dist.is_initialized()):
        if mesh.num_devices > 1 and _launched_world() > 1:
            _forgotten_initialize(mesh)
        return _LOADED.get("simulated.backend") or _module("simulated.backend")
    groups = _LOADED.get("process.groups") or _module("process.groups")
    if mesh in groups.WORLD.checked or groups.process_mesh(mesh):
        return _LOADED.get("process.backend") or _module("process.backend")
    return _module("simulated.backend")


def world_started() -> bool:
    """Whether this process is in a process world (torch.distributed initialized): what
    :func:`backend_for`'s answer depends on besides the mesh.

    >>> world_started()
    False
    """
    return _dist_available and dist.is_initialized()


_WORLD: list[int] = []


def _launched_world() -> int:
    """``WORLD_SIZE`` from the launcher's environment (1 when absent), read once:
    torchrun sets it before the process starts."""
    if not _WORLD:
        try:
            _WORLD.append(int(os.environ.get("WORLD_SIZE", "1")))
        except ValueError:
            _WORLD.append(1)
    return _WORLD[0]


def _forgotten_initialize(mesh: DeviceMesh) -> None:
    raise ShardingError(
        f"This process is one of WORLD_SIZE={_launched_world()} processes (launched by "
        f"torchrun; RANK={os.environ.get('RANK', '?')}), but the multi-process runtime was "
        f"not started, so {mesh!r} would be simulated whole in every process: each would do "
        "all the work and none would talk to the others. Call "
        "shardwise.distributed.initialize() (or maybe_initialize(), which also runs "
        "unchanged without torchrun) before building tensors on a mesh."
    )


def check_reduce(x: torch.Tensor, op: ReduceOp) -> None:
    """Refuse a reduction that ``x``'s dtype cannot do, with the same
    :class:`ShardingTypeError` on every runtime and mesh size (torch would fail
    inside a collective or truncate): AVG of integers or bools, MIN/MAX of complex
    numbers. (SUM of bools is a logical or on both runtimes, as torch's bool add.)

    >>> check_reduce(torch.ones(2, dtype=torch.int64), ReduceOp.SUM)  # fine
    """
    if op is ReduceOp.SUM:
        return
    dtype = x.dtype
    if op is ReduceOp.AVG:
        if not (x.is_floating_point() or x.is_complex()):
            _refuse(dtype, op, f"the mean of integer dtype {dtype} values is not an integer; "
                    "cast to a floating dtype first, or use SUM")
    elif (op is ReduceOp.MAX or op is ReduceOp.MIN) and x.is_complex():
        _refuse(dtype, op, "complex numbers have no order; reduce .real/.abs() or use "
                "SUM/AVG/PROD")


def _refuse(dtype: torch.dtype, op: ReduceOp, why: str) -> None:
    raise ShardingTypeError(
        f"Cannot reduce values of dtype {dtype} with ReduceOp.{op.name} ({op.value!r}): "
        f"{why}."
    )
