"""Bodies for fault tests: one rank dies or calls a different collective; the
others must raise CollectiveError within the collective timeout, not hang."""

from __future__ import annotations

import os
import time

import torch

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Sharded
from shardwise.distributed import CollectiveError, process_index

TIMEOUT_S = 10.0  # matches the timeout the fault tests pass to the harness


def _expect_error(fn) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        fn()
    except CollectiveError as err:
        elapsed = time.monotonic() - start
        assert elapsed < TIMEOUT_S + 15, f"error came after {elapsed:.1f}s"
        assert "rank" in str(err)
        return
    raise AssertionError("the collective succeeded although a peer was dead/mismatched")


def body_dead_rank(n: int) -> None:
    mesh = DeviceMesh.cpu((n,), ("x",))
    t = sw.tensor(torch.ones(4 * n, 2), sharding=PlacementMapping(mesh, [Sharded(0)]))
    sw.all_gather(t)  # all ranks healthy: warm up the group
    if process_index() == n - 1:
        os._exit(17)
    _expect_error(lambda: [sw.all_gather(t) for _ in range(3)])


def body_mismatched_collective(n: int) -> None:
    mesh = DeviceMesh.cpu((n,), ("x",))
    t = sw.tensor(torch.ones(4 * n, 2), sharding=PlacementMapping(mesh, [Sharded(0)]))
    sw.all_gather(t)
    if process_index() == 0:
        _expect_error(lambda: sw.all_gather(t))
    else:
        _expect_error(lambda: sw.all_reduce(sw.tensor(torch.ones(3), sharding=PlacementMapping(
            mesh, [sw.Partial()]))))


def body_same_size_mismatch_checked(n: int) -> None:
    """Two different collectives of the same size would exchange data silently;
    with collective checking on, both sides raise instead."""
    from shardwise.runtime.process.world import WORLD

    WORLD.check_collectives = True
    mesh = DeviceMesh.cpu((n,), ("x",))
    p = sw.tensor(torch.ones(4, 2), sharding=PlacementMapping(mesh, [sw.Partial()]))
    sw.all_reduce(p)
    if process_index() == 0:
        _expect_error(lambda: sw.all_reduce(p, reduce_op="max"))
    else:
        _expect_error(lambda: sw.all_reduce(p))


def body_rank_exits_silently(n: int) -> None:
    """The last rank leaves without reporting (exit code 0); the others pass."""
    if process_index() == n - 1:
        os._exit(0)
