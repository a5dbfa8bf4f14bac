"""Process groups over mesh axes, as seen from this process.

Invariants:
- Process ``i`` owns the mesh devices whose id is ``i``; :func:`my_index` caches
  this process's index per mesh (valid for one world: :func:`reset_groups` clears it).
- Process groups are created once per (mesh, sorted axes), collectively, every process
  in the same order, after agreeing over the world on which group it creates
  (torch pairs ``new_group`` calls by order); axes in another order reuse them.
- A torch process group is keyed by its member ranks (``WORLD.pgs``, the same on
  every process: only collective creations fill it), so a member set gets one group
  whatever mesh names it. A pipeline stage's mesh (registered by
  :func:`prepare_stage_groups`, which every process runs, in one order) takes its
  groups from there with no collective call, so a stage's processes use their mesh
  alone; a process outside a stage mesh that reaches one of its collectives gets an
  error, never a wait. Every other mesh still agrees over the world before its first
  group (the agreement catches a divergent program there, with its position).
- Where point-to-point streams need their own groups (NCCL, or the Gloo test hook:
  :func:`~shardwise.runtime.process.p2p.needs_stream_groups`),
  :func:`prepare_stage_groups` also creates one two-rank group per stream: per pair of
  adjacent stages, each direction, at each coordinate of the stage meshes whose two
  ranks differ. ``WORLD.streams`` keys them by (sender rank, receiver rank, stream
  tag), the same on every process; a stream's group is never shared, even by
  streams between the same two ranks (NCCL would pair their transfers).
- Every group is created with the run's timeout (torch's default for new groups is
  30 minutes). An NCCL stream group then gets a week (its receive waits, posted ahead,
  through the pause between steps; p2p bounds every wait by the run's timeout).
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from shardwise.runtime.process import agreement, p2p
from shardwise.runtime.process.world import WORLD
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.shapes import local_shape

__all__ = ["Group", "group", "is_process_mesh", "my_index", "prepare_stage_groups",
           "process_mesh", "refuse_outsider", "reset_groups", "stream_groups", "stream_pairs",
           "world_group"]

_STREAM_IDLE = datetime.timedelta(days=7)  # NCCL stream groups' watchdog (see stream_groups)


class Group:
    """A process group over mesh axes, as seen from this process."""

    __slots__ = ("label", "members", "pg", "pos", "ranks", "slot")

    def __init__(self, pg: Any, members: tuple[int, ...], ranks: tuple[int, ...],
                 pos: int, label: str = "") -> None:
        self.pg = pg            # torch ProcessGroup (None when this process is not a member)
        self.members = members  # flat mesh indices, row-major over the axes
        self.ranks = ranks
        self.pos = pos          # this process's position among the members
        self.label = label      # e.g. "mesh axes ('tp',) of DeviceMesh(dp=2, tp=2)"
        # torch orders a group's members by global rank; slot[p] is member p's place
        # in that order (None when it is the members' own order).
        order = sorted(ranks)
        slot = tuple(order.index(r) for r in ranks)
        self.slot = None if slot == tuple(range(len(ranks))) else slot

    def by_slot(self, items: Sequence[Any]) -> list[Any]:
        """Per-member items -> the order torch's collective uses."""
        if self.slot is None:
            return list(items)
        out: list[Any] = [None] * len(items)
        for p, item in enumerate(items):
            out[self.slot[p]] = item
        return out

    def by_member(self, items: Sequence[Any]) -> list[Any]:
        """Items in torch's order -> per-member order."""
        return list(items) if self.slot is None else [items[j] for j in self.slot]

    @property
    def size(self) -> int:
        return len(self.members)




def reset_groups() -> None:
    """Forget this world's groups, channels, checks and specs (shutdown/initialize)."""
    WORLD.reset()


def rank() -> int:
    return int(dist.get_rank())


# Per mesh: this process's index in it (None: not a member). Cached because every
# op asks; valid for one world, so reset_groups() (shardwise.distributed.shutdown)
# clears it with the process groups.


def is_process_mesh(mesh: DeviceMesh) -> bool:
    """True when the mesh's devices are processes of the initialized world."""
    return dist.is_available() and dist.is_initialized() and process_mesh(mesh)


def process_mesh(mesh: DeviceMesh) -> bool:
    """:func:`is_process_mesh` once the world is known to be initialized (errors
    when the mesh names more devices than there are processes)."""
    if mesh in WORLD.checked:
        return True
    world = dist.get_world_size()
    big = [d for d in mesh.devices if getattr(d, "id", -1) >= world]
    if big:
        raise ShardingError(
            f"{mesh!r} names devices {big[:4]} but this run has {world} processes (device i "
            f"is process i): build meshes of at most {world} devices, or launch more "
            "processes (torchrun --nproc-per-node)."
        )
    WORLD.checked.add(mesh)
    return True


def my_index(mesh: DeviceMesh) -> int | None:
    """This process's flat index among ``mesh``'s devices, or None."""
    try:
        return WORLD.index[mesh]
    except KeyError:
        pass
    me = rank()
    k = next((k for k, d in enumerate(mesh.devices) if d.id == me), None)
    WORLD.index[mesh] = k
    return k


def group(mesh: DeviceMesh, axes: tuple[int, ...]) -> Group:
    """This process's group over ``axes`` of ``mesh`` (created once, collectively),
    its members row-major over ``axes`` in the order given.

    Only sorted axes create process groups; axes in another order reuse those of
    their sorted order (the same members), so naming them needs no collective
    call once the sorted group exists (shard_map creates every sorted one up front)."""
    key = (mesh, axes)
    hit = WORLD.groups.get(key)
    if hit is not None:
        return hit
    me = my_index(mesh)
    label = f"mesh axes {tuple(mesh.axis_names[a] for a in axes)} of {mesh!r}"
    base_axes = tuple(sorted(axes))
    if base_axes != axes:
        base = group(mesh, base_axes)
        result = Group(None, (), (), -1, label)
        if base.pos >= 0 and me is not None:
            members = next(m for m in mesh.groups(axes) if me in m)
            ranks = tuple(mesh.devices[k].id for k in members)
            result = Group(base.pg, tuple(members), ranks, members.index(me), label)
        WORLD.groups[key] = result
        return result
    # a pipeline stage's mesh: every member set has its group already (made on every
    # process by prepare_stage_groups), so its processes take them with no collective
    found = _known(mesh, axes, me, label) if mesh in WORLD.stages else None
    if found is not None:
        WORLD.groups[key] = found
        return found
    # torch.compile may meet a group first while it traces (fake or traced tensors):
    # creating it is a one-time exchange of real messages, outside the trace
    with _disable_current_modes():
        return _create(mesh, axes, me, key, label)


def _create(mesh: DeviceMesh, axes: tuple[int, ...], me: int | None, key: Any,
            label: str) -> Group:
    world = world_group()
    # Creating groups is collective over the world, matched by call order: processes
    # creating different groups would pair them up silently, so they agree first.
    agreement.agree(world.pg, world.ranks, world.label,
            agreement.fingerprint("create process groups", None, label, (), None))
    for members in mesh.groups(axes):
        ranks = tuple(sorted(mesh.devices[k].id for k in members))
        if 1 < len(ranks) < world.size and ranks not in WORLD.pgs:
            # every process calls this, member or not
            WORLD.pgs[ranks] = agreement.run("creating process groups", world.label, world.ranks,
                                             lambda r=ranks: dist.new_group(list(r),
                                                                    timeout=agreement.timeout()))
    made = _known(mesh, axes, me, label)
    assert made is not None, "every member set was just given a group"
    WORLD.groups[key] = made
    return made


def _known(mesh: DeviceMesh, axes: tuple[int, ...], me: int | None, label: str
           ) -> Group | None:
    """This process's group over ``axes`` from the groups made so far (by member ranks),
    or None when some member set has none yet (the same answer on every process)."""
    world = dist.get_world_size()
    found = Group(None, (), (), -1, label)
    for members in mesh.groups(axes):
        ranks = tuple(mesh.devices[k].id for k in members)
        key = tuple(sorted(ranks))
        if len(ranks) == world:
            pg: Any = dist.group.WORLD
        elif len(ranks) == 1:
            pg = None
        elif key in WORLD.pgs:
            pg = WORLD.pgs[key]
        else:
            return None
        if me is not None and me in members:
            found = Group(pg, tuple(members), ranks, members.index(me), label)
    return found


def prepare_stage_groups(mesh: DeviceMesh, axis: str,
                         stages: Sequence[DeviceMesh] | None = None) -> list[DeviceMesh]:
    """Create, on every process in one order, the groups of ``mesh`` over every sorted
    subset of its axes; then each stage mesh's groups (``stages``, by default
    ``mesh.submesh(axis=i)`` for each ``i``) are the same torch groups, found by member
    ranks with no collective call, so a stage's processes run their stage's ops alone.
    Call it on every process (it is collective over the world), before any stage runs
    an op (``pipeline()`` does). Where streams need their own groups (NCCL), it then
    creates those of the adjacent stages' streams (:func:`stream_groups`). Returns the
    stage meshes, which refuse a process outside them (:func:`refuse_outsider`).

    >>> prepare_stage_groups(DeviceMesh.cpu((2, 2), ("pp", "tp")), "pp")  # doctest: +SKIP
    [DeviceMesh(tp=2), DeviceMesh(tp=2)]
    """
    pp = mesh.axis_index(axis)
    for n in range(1, mesh.ndim + 1):
        for axes in itertools.combinations(range(mesh.ndim), n):
            group(mesh, axes)
    subs = (list(stages) if stages is not None else
            [mesh.submesh(**{axis: i}) for i in range(mesh.mesh_shape[pp])])
    for sub in subs:
        WORLD.stages.add(sub)
        for n in range(1, sub.ndim + 1):
            for axes in itertools.combinations(range(sub.ndim), n):
                group(sub, axes)  # found by ranks when a submesh of ``mesh``: local
    if p2p.needs_stream_groups():
        stream_groups(subs)
    return subs


def stream_pairs(stages: Sequence[DeviceMesh]) -> list[tuple[int, int, int]]:
    """The point-to-point streams between adjacent stages (the executor's only
    transfers: activations forward, gradients back), as (sender rank, receiver rank,
    tag), in one order: per pair of stages, each direction, each mesh coordinate whose
    two ranks differ.

    >>> stream_pairs([DeviceMesh.cpu(2, "tp"), DeviceMesh.cpu(2, "tp")])
    []
    """
    out: list[tuple[int, int, int]] = []
    for s in range(len(stages) - 1):
        for a, b in ((s, s + 1), (s + 1, s)):
            src, dst = stages[a].devices, stages[b].devices
            if len(src) != len(dst):  # the transport refuses stages of two shapes
                continue
            tag = p2p.stream_tag(a, b)
            out.extend((x.id, y.id, tag) for x, y in zip(src, dst) if x.id != y.id)
    return out


def stream_groups(stages: Sequence[DeviceMesh]) -> None:
    """Give every stream between adjacent ``stages`` its own two-rank process group
    (``WORLD.streams``), collectively on every process in one order (the streams are
    the same list everywhere; those made before are kept)."""
    todo = [k for k in dict.fromkeys(stream_pairs(stages)) if k not in WORLD.streams]
    if not todo:
        return
    world = world_group()
    agreement.agree(world.pg, world.ranks, world.label,
            agreement.fingerprint("create process groups", None, f"point-to-point streams {todo}",
                                  (), None))
    nccl = dist.get_backend() == "nccl"
    for key in todo:
        ranks = sorted(key[:2])
        pg = WORLD.streams[key] = agreement.run(
            "creating process groups", world.label, world.ranks,
            lambda r=ranks: dist.new_group(r, timeout=agreement.timeout()))
        if nccl and rank() in ranks:
            # NCCL's watchdog times every work from its enqueue and takes the process
            # down at the group's timeout; a stream's next receive is posted ahead and
            # may wait through the pause between two steps (optimizer, checkpoint,
            # eval). p2p bounds each wait itself (from the wait's start), so the
            # watchdog of a stream's group only catches what nothing waits for.
            dist.distributed_c10d._set_pg_timeout(_STREAM_IDLE, pg)


def refuse_outsider(mesh: DeviceMesh, what: str) -> None:
    """Raise when this process is outside a pipeline stage's mesh and reaches one of
    its collectives (only the stage's processes run them: waiting would never end)."""
    if mesh in WORLD.stages and my_index(mesh) is None:
        raise ShardingError(
            f"{what} on {mesh!r} (devices {[d.id for d in mesh.devices]}) reached rank "
            f"{rank()}, which holds no device of this pipeline stage: only the stage's "
            "processes run its ops. Run the op on the stage's ranks only (check "
            "`stage.mesh` / `pipe.local_stages`), or use the parent mesh.")


def world_group() -> Group:
    world = dist.get_world_size()
    return Group(dist.group.WORLD, tuple(range(world)), tuple(range(world)), rank(), "world")


def sizes_along(shape: tuple[int, ...], layout: Layout, members: Sequence[int], dim: int,
                mesh: DeviceMesh) -> list[int]:
    return [local_shape(shape, layout, mesh.coord_of(m))[dim] for m in members]
