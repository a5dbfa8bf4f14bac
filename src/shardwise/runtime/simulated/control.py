"""The simulated backend's world (the protocol's world block, its links and stages): a
world of this one process, where a barrier has no one to wait for, a gather over the
world is this process's value alone, and every point-to-point link is a loopback.

Invariants:
- :func:`process_index` is 0 and :func:`process_count` 1, as ``shardwise.distributed``
  reports without ``initialize()``.
- One :class:`~shardwise.runtime.loopback.Loopback` per (meshes, device, stages): its
  sender and its receiver, both here, find the same one.
- The first failure recorded and the links stay until :func:`end_world` (or
  :func:`begin_world`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise.runtime.loopback import Loopback
from shardwise.sharding.mesh import DeviceMesh

__all__ = ["barrier", "begin_world", "end_world", "first_failure", "flush_links",
           "gather_world", "link", "prepare_stages", "process_count", "process_index",
           "record_failure"]

_FIRST: list[str] = []   # the run's first failure, once recorded
_LINKS: dict[tuple[DeviceMesh, DeviceMesh, int, tuple[int, int]], Loopback] = {}


def link(src: DeviceMesh, dst: DeviceMesh, k: int, stages: tuple[int, int]) -> Loopback:
    """The link from device ``k`` of ``src`` to device ``k`` of ``dst``: both in this
    process, a loopback (the same one for its sender and its receiver).

    >>> mesh = DeviceMesh.cpu((2, 1), ("pp", "x"))
    >>> a, b = mesh.submesh(pp=0), mesh.submesh(pp=1)
    >>> link(a, b, 0, (0, 1)).send([], [torch.ones(1)], "F0")
    >>> link(a, b, 0, (0, 1)).recv("F0")
    ([], [tensor([1.])])
    """
    key = (src, dst, k, stages)
    made = _LINKS.get(key)
    if made is None:
        made = _LINKS[key] = Loopback(f"device {k} of stage {stages[0]} -> stage {stages[1]}")
    return made


def flush_links() -> None:
    """Nothing to wait for: a loopback's transfer is there once sent.

    >>> flush_links()
    """


def prepare_stages(mesh: DeviceMesh, axis: str, stages: Sequence[DeviceMesh]
                   ) -> list[DeviceMesh]:
    """The stage meshes as they are: a simulated mesh's groups need no making.

    >>> mesh = DeviceMesh.cpu((2, 2), ("pp", "tp"))
    >>> prepare_stages(mesh, "pp", [mesh.submesh(pp=0), mesh.submesh(pp=1)])
    [DeviceMesh(tp=2), DeviceMesh(tp=2; devices 2..3)]
    """
    return list(stages)


def begin_world(*, timeout_s: float, check_collectives: bool | None = None) -> None:
    """Start afresh: nothing to bound (no process waits for another), nothing to check
    (no collective leaves this process).

    >>> begin_world(timeout_s=60.0); first_failure()
    ''
    """
    end_world()


def end_world() -> None:
    """Forget the world's first failure and its links.

    >>> _ = record_failure("a save failed")
    >>> end_world(); first_failure()
    ''
    """
    _FIRST.clear()
    _LINKS.clear()


def process_index() -> int:
    """0: this process is the world.

    >>> process_index()
    0
    """
    return 0


def process_count() -> int:
    """1: this process is the world.

    >>> process_count()
    1
    """
    return 1


def barrier(label: str) -> None:
    """Nothing to wait for: every process of the world is here.

    >>> barrier("after the save")
    """


def gather_world(x: torch.Tensor, label: str) -> torch.Tensor:
    """``x`` alone, stacked: shape ``(1, *x.shape)`` (it is the only rank's).

    >>> gather_world(torch.tensor([3, 4]), "hashes").tolist()
    [[3, 4]]
    """
    return x.unsqueeze(0)


def record_failure(text: str) -> str:
    """Record ``text`` as the first failure unless one is recorded; returns the first.

    >>> end_world(); record_failure("one"), record_failure("two")
    ('one', 'one')
    """
    if not _FIRST:
        _FIRST.append(text[:400])
    return _FIRST[0]


def first_failure() -> str:
    """The first failure recorded ("" when none).

    >>> end_world(); first_failure()
    ''
    """
    return _FIRST[0] if _FIRST else ""
