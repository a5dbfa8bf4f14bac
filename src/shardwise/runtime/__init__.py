"""Runtime backends: where a Tensor's shards live and how plan steps execute.

One protocol (:class:`Backend`, shard_map's SPMD bodies included: ``run_spmd`` and
``spmd_outputs``; the world's services: ``barrier``, ``first_failure``...), two backends
in their own subpackages: ``simulated/`` (every device of the mesh in this process) and
``process/`` (one process per device, torch.distributed). It is the only door to a
runtime: ops pick the backend from the mesh (:func:`backend_for`), what concerns no
mesh asks :func:`world_backend`, and nothing above this floor imports a backend's
package. Shared by both, on this floor: ``blocks`` (block recipes), ``buffers`` (large
result buffers), ``collectives`` (the collectives of values this process holds),
``spmd`` (the axis environment of a running shard_map body), ``observe`` (observers of
collectives).

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

from shardwise.planner import Plan, Step
from shardwise.runtime.owner import GradOwner
from shardwise.runtime.world import C10D
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp

if TYPE_CHECKING:
    from shardwise.propagation.binding import Factors
    from shardwise.propagation.decide import Decision

__all__ = ["Backend", "Decided", "GradOwner", "Link", "SpmdOutputs", "backend_for",
           "check_reduce", "holds_whole", "world_backend", "world_started"]


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
                     layouts: Sequence[Layout], check: bool,
                     shapes: Sequence[tuple[int, ...] | None] = ()) -> SpmdOutputs:
        """shard_map's outputs from ``run_spmd``'s blocks (``blocks[j][k]``: output
        ``j`` of device ``k``, None where another process holds it), one layout each;
        ``shapes[j]``: output ``j``'s global shape where the caller knows it (its blocks'
        shapes then follow from the layout: nothing is exchanged for them).
        Returns per output: every device's (block shape, dtype) or None when not
        needed (no sharded dim and no check: this process's block gives the shape);
        the shards of the output (replicas share coordinate 0's block, a replica off
        coordinate 0 gets no gradient); and, when ``check``, None or the devices
        ``(k, r)`` whose blocks differ where the layout replicates them (``()``:
        some, unnamed)."""
        ...

    # --- point-to-point between meshes and pipeline stages (the pipeline transport)
    def link(self, src: DeviceMesh, dst: DeviceMesh, k: int, stages: tuple[int, int]
             ) -> Link:
        """The point-to-point link from device ``k`` of ``src`` to device ``k`` of ``dst``
        (meshes of one shape), whose transfers pair in order on the stream of the
        pipeline stages ``stages`` (source, destination), never with another stream's.
        This process holds one of its ends (the process backend refuses a link it holds
        no end of) or both (a loopback: every link of the simulated backend)."""
        ...

    def flush_links(self) -> None:
        """Wait until every transfer this process sent on a link was received (bounded)."""
        ...

    def prepare_stages(self, mesh: DeviceMesh, axis: str, stages: Sequence[DeviceMesh]
                       ) -> list[DeviceMesh]:
        """Make ready the meshes ``stages`` of a pipeline over ``axis`` of ``mesh``, on
        every process in one order, so that each stage's processes later run its ops
        (and its links) alone; returns the stage meshes."""
        ...

    # --- this process's world (no mesh; reached through world_backend()): the
    # torch.distributed world on the process backend, this one process on the simulated
    # one. What api/distributed, checkpoint and the replica check ask of a runtime.
    def begin_world(self, *, timeout_s: float, check_collectives: bool | None = None
                    ) -> None:
        """Start this world's bookkeeping afresh (nothing of an earlier world survives),
        with the run's settings: every wait bounded by ``timeout_s``; the heavy debug
        check of every collective on or off (None: as it is, by default what
        ``SHARDWISE_CHECK_COLLECTIVES`` says)."""
        ...

    def end_world(self) -> None:
        """Forget this world's groups, streams and caches (shutdown, a failed start)."""
        ...

    def process_index(self) -> int:
        """This process's rank in the world (0 in a world of one process)."""
        ...

    def process_count(self) -> int:
        """How many processes the world holds."""
        ...

    def barrier(self, label: str) -> None:
        """Wait until every process arrives at the barrier ``label`` (bounded); raises
        :class:`CollectiveError` on all of them when one stays away or calls another."""
        ...

    def gather_world(self, x: torch.Tensor, label: str) -> torch.Tensor:
        """Every process's ``x`` (one shape and dtype on all), stacked in rank order:
        shape ``(process_count(), *x.shape)``; a collective over the world named ``label``."""
        ...

    def record_failure(self, text: str) -> str:
        """Record ``text`` as the run's first failure unless one is recorded already;
        returns the first failure ("" when it cannot be read)."""
        ...

    def first_failure(self) -> str:
        """The run's first recorded failure ("" when none)."""
        ...


class Link(Protocol):
    """One direction of point-to-point transfers between two devices (:meth:`Backend.link`):
    a transfer is ``info`` (a JSON value: what the receiver needs to use the tensors)
    and plain torch tensors, under a ``key`` both ends name alike (a mismatch raises
    :class:`CollectiveError` on the receiver). Sends return at once; received tensors
    are new leaves that never require grad."""

    peer: int | None
    """The rank at the other end (None: this process holds both ends)."""

    def send(self, info: Any, tensors: Sequence[torch.Tensor], key: str) -> None: ...

    def recv(self, key: str) -> tuple[Any, list[torch.Tensor]]: ...


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
    if C10D._default_pg is None:
        if mesh.num_devices > 1 and _launched_world() > 1:
            _forgotten_initialize(mesh)
        return _LOADED.get("simulated.backend") or _module("simulated.backend")
    groups = _LOADED.get("process.groups") or _module("process.groups")
    if mesh in groups.WORLD.checked or groups.process_mesh(mesh):
        return _LOADED.get("process.backend") or _module("process.backend")
    return _module("simulated.backend")


def holds_whole(mesh: DeviceMesh) -> bool:
    """Whether this process holds every device of ``mesh`` (the simulated mesh; a world
    of one process for a one-device mesh), so that values on it may stay whole.

    >>> holds_whole(DeviceMesh.cpu(2, "x"))
    True
    """
    return len(backend_for(mesh).owned(mesh)) == mesh.num_devices


def world_started() -> bool:
    """Whether this process is in a process world (torch.distributed initialized): what
    :func:`backend_for`'s answer depends on besides the mesh.

    >>> world_started()
    False
    """
    return C10D._default_pg is not None


def world_backend() -> Backend:
    """The backend of this process's world, for what concerns no mesh (a barrier, the
    run's first failure, starting and ending the world): the torch.distributed backend
    once its world is initialized, else the simulated one, whose world is this process.

    >>> world_backend().process_count()   # not under torchrun: a world of one process
    1
    """
    if C10D._default_pg is not None:
        return _module("process.backend")
    return _module("simulated.backend")


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
