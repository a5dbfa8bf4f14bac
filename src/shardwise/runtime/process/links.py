"""The process backend's point-to-point links (the ``Backend`` protocol's ``link``): one
direction between device ``k`` of one mesh and device ``k`` of another, as this process
sees it, over :mod:`.p2p`'s stream of a pair of pipeline stages. What the pipeline
transport sends and receives through.

Invariants:
- A link's ends are the processes ``src.devices[k]`` and ``dst.devices[k]``; this
  process is one of them (else it is refused), or both (then it is a
  :class:`~shardwise.runtime.loopback.Loopback`).
- A link carries the stream of its stage pair (:func:`p2p.stream_tag`): on Gloo over
  the world group, separated by the tag; where streams need their own groups (NCCL, or
  the Gloo test hook) over the stream's group in ``WORLD.streams``, made by
  ``prepare_stage_groups``; a missing one is refused at the transfer, naming the fix.
- Gloo or NCCL only: another backend, NCCL without a GPU or a torch without NCCL is
  refused when the link is made.
- Links belong to one world (``WORLD.links``, cleared with it); a transfer costs one
  call more than :mod:`.p2p`'s own (the link holds the peer, the tag and the group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwise.runtime.loopback import Loopback
from shardwise.runtime.process import collectives, p2p
from shardwise.runtime.process.world import WORLD
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.mesh import DeviceMesh

__all__ = ["Link", "flush_links", "link"]


class Link:
    """One direction between this process and ``peer``, on the stream of the stage pair
    ``stages`` (see the module invariants).

    >>> a, b = mesh.submesh(pp=0), mesh.submesh(pp=1)   # under torchrun  # doctest: +SKIP
    >>> link(a, b, 0, (0, 1)).send(["any JSON"], [x], "F0")   # rank 0  # doctest: +SKIP
    >>> link(a, b, 0, (0, 1)).recv("F0")                      # rank 1  # doctest: +SKIP
    (['any JSON'], [tensor(...)])
    """

    __slots__ = ("_stream", "_streams", "peer", "stages", "tag")

    def __init__(self, peer: int, sender: int, receiver: int, stages: tuple[int, int]) -> None:
        self.peer = peer
        self.stages = stages
        self.tag = p2p.stream_tag(*stages)
        self._stream = (sender, receiver, self.tag)
        # NCCL: the stream's own group (WORLD.streams); Gloo: None, the world group and
        # its tag (one dict lookup less per transfer)
        self._streams = WORLD.streams if p2p.needs_stream_groups() else None

    def send(self, info: Any, tensors: Sequence[torch.Tensor], key: str) -> None:
        """Send ``info`` (JSON) and ``tensors`` to the peer under ``key``; returns at once
        (:func:`flush_links` waits)."""
        p2p.send_parts(info, tensors, self.peer, self.tag, key,
                       None if self._streams is None else self._group())

    def recv(self, key: str) -> tuple[Any, list[torch.Tensor]]:
        """The peer's next transfer, which must be ``key``: ``(info, tensors)``."""
        return p2p.recv_parts(self.peer, self.tag, key,
                              None if self._streams is None else self._group())

    def _group(self) -> Any:
        assert self._streams is not None
        pg = self._streams.get(self._stream)
        if pg is None:
            (sender, receiver, _), (src, dst) = self._stream, self.stages
            raise ShardingError(
                f"Pipeline transfer from stage {src} (rank {sender}) to stage {dst} (rank "
                f"{receiver}): this backend ({dist.get_backend()!r}) needs a process group "
                "per stream and this one has none. Build the stages with pipeline(), or "
                "call shardwise.runtime.backend_for(mesh).prepare_stages(mesh, axis, "
                "stage_meshes) on every process before the first transfer.")
        return pg


def link(src: DeviceMesh, dst: DeviceMesh, k: int, stages: tuple[int, int]) -> Link | Loopback:
    """The link from device ``k`` of ``src`` to device ``k`` of ``dst`` (made once per
    world), on the stream of the pipeline stages ``stages``.

    >>> link(stage0, stage1, 0, (0, 1)).peer   # on rank 0, stage 1 on rank 2  # doctest: +SKIP
    2
    """
    key = (src, dst, k, stages)
    made = WORLD.links.get(key)
    if made is not None:
        return made
    p2p.check_backend("The pipeline transport between processes")
    sender, receiver, me = src.devices[k].id, dst.devices[k].id, collectives.rank()
    if sender == receiver == me:
        made = Loopback(f"device {k} of stage {stages[0]} -> stage {stages[1]}, rank {me}")
    elif me in (sender, receiver):
        made = Link(receiver if me == sender else sender, sender, receiver, stages)
    else:
        raise ShardingError(
            f"A point-to-point link from device {k} of {src!r} (rank {sender}) to device "
            f"{k} of {dst!r} (rank {receiver}) has no end on rank {me}: only its two "
            "processes send and receive on it.")
    WORLD.links[key] = made
    return made


def flush_links() -> None:
    """Wait until every transfer this process sent was received (each wait bounded).

    >>> flush_links()   # after a pipeline step's sends  # doctest: +SKIP
    """
    p2p.flush()
