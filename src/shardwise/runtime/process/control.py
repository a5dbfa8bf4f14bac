"""The process backend's world services (the protocol's world block): starting and
ending this process's torch.distributed world, its barrier, a gather over it, and the
run's first failure.

Invariants:
- :func:`begin_world` starts the world's bookkeeping afresh (``WORLD.reset``: nothing
  of an earlier world survives, however it ended) before setting the run's settings;
  :func:`end_world` forgets it.
- :func:`barrier` and :func:`gather_world` are collectives over the world like any
  other: they agree first and every wait is bounded by the run's timeout.
- The first failure lives in the rendezvous store (:mod:`.diagnose`), so every rank
  reads the same one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.runtime.process import agreement, collectives
from shardwise.runtime.process.diagnose import first_failure
from shardwise.runtime.process.diagnose import record as record_failure
from shardwise.runtime.process.world import WORLD

__all__ = ["barrier", "begin_world", "end_world", "first_failure", "gather_world",
           "process_count", "process_index", "record_failure"]


def begin_world(*, timeout_s: float, check_collectives: bool | None = None) -> None:
    """Start the world's bookkeeping afresh with the run's settings (``initialize()``,
    once torch.distributed's world is up).

    >>> begin_world(timeout_s=60.0); WORLD.timeout_s
    60.0
    """
    WORLD.reset()
    WORLD.timeout_s = float(timeout_s)
    if check_collectives is not None:
        WORLD.check_collectives = check_collectives


def end_world() -> None:
    """Forget the world's groups, streams and caches (``shutdown()``).

    >>> end_world(); WORLD.groups
    {}
    """
    WORLD.reset()


def process_index() -> int:
    """This process's rank.

    >>> process_index()   # rank 1 of a torchrun world  # doctest: +SKIP
    1
    """
    return collectives.rank()


def process_count() -> int:
    """The world's size.

    >>> process_count()   # torchrun --nproc-per-node 4  # doctest: +SKIP
    4
    """
    return int(dist.get_world_size())


def barrier(label: str) -> None:
    """Every process arrives at ``label`` (bounded): one control message over the world.

    >>> barrier("checkpoint written")   # on every rank  # doctest: +SKIP
    """
    world = collectives.world_group()
    agreement.agree(world.pg, world.ranks, world.label,
            agreement.fingerprint(label, None, world.label, (), None))


def gather_world(x: torch.Tensor, label: str) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order (one all_gather over the world).

    >>> gather_world(torch.tensor([process_index()]), "ranks").tolist()  # doctest: +SKIP
    [[0], [1]]
    """
    world = collectives.world_group()
    return collectives.all_gather(x.unsqueeze(0), 0, world, [1] * world.size, label)
