"""Bodies for fault tests: one rank dies or calls a different collective; the
others must raise CollectiveError within the collective timeout, not hang."""

from __future__ import annotations

import os
import signal
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


# --- issue 24: bounded whatever the store's host does; the culprit, not a bystander ---------
FAST_TIMEOUT_S = 3.0  # the timeout of the launches below (short: each test waits it out)
# What may come on top of the timeout: naming the absent ranks (2 s without an answer
# from the store), a bystander's wait for the witness (up to 3 s) and delay (1 s), a
# loaded machine.
FAST_SLACK_S = 9.0
STAGGER_S = 1.5  # the witnesses start waiting this late: the bystander times out first


def _timed_error(fn) -> tuple[str, float]:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        fn()
    except CollectiveError as err:
        return str(err), time.monotonic() - start
    raise AssertionError("the collective returned although a peer was frozen or stalled")


def body_store_host_frozen(n: int) -> None:
    """Rank 0 hosts the store (a plain rendezvous) and freezes (SIGSTOP) before an
    all_reduce: every other rank raises within the timeout + slack, naming the frozen
    host and the wait's real length."""
    mesh = DeviceMesh.cpu((n,), ("x",))
    p = sw.tensor(torch.ones(4, 2), sharding=PlacementMapping(mesh, [sw.Partial()]))
    sw.all_reduce(p)  # all ranks healthy: the store answers
    if process_index() == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # the harness kills it
        return
    text, took = _timed_error(lambda: sw.all_reduce(p))
    assert took < FAST_TIMEOUT_S + FAST_SLACK_S, f"the error came after {took:.1f} s: {text}"
    assert "the store's host (rank 0, 127.0.0.1:" in text and "did not answer within" in text, \
        text
    said = float(text.split("timed out after ")[1].split(" s")[0])
    assert FAST_TIMEOUT_S - 0.5 < said <= took + 0.05, (said, took, text)


RAISED_AT = "shardwise-test/raised/"


def body_stalled_rank_culprit(n: int) -> None:
    """A 2x2 (dp, tp) mesh; rank 2 stalls before the dp all_reduce. Rank 0 waits for it
    in dp {0, 2}; rank 1, done with dp {1, 3}, waits for rank 0 in tp {0, 1}: rank 1's
    error names rank 2 as the culprit and says it raised because of it, every error
    names rank 2, and rank 1 (a bystander) raises after rank 0 (the witness) although
    it times out first (the witnesses start waiting ``STAGGER_S`` late)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    assert n == 4
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    p = sw.tensor(torch.ones(4, 2), sharding=PlacementMapping(mesh, [sw.Partial(),
                                                                      sw.Partial()]))
    dp = lambda: sw.all_reduce(p, reduce_axes="dp")  # noqa: E731
    tp = lambda: sw.all_reduce(p, reduce_axes="tp")  # noqa: E731
    dp(), tp()  # warm up both groups
    me = dist.get_rank()
    if me == 2:
        time.sleep(FAST_TIMEOUT_S + FAST_SLACK_S)  # stalled past everyone's error
        return

    def step() -> None:
        if me == 0:
            time.sleep(STAGGER_S)
        dp()
        if me == 3:
            time.sleep(STAGGER_S)
        tp()

    text, took = _timed_error(step)
    assert took < FAST_TIMEOUT_S + FAST_SLACK_S, f"the error came after {took:.1f} s: {text}"
    assert "rank 2" in text or "[2]" in text, text
    if me == 1:
        assert "The culprit: rank 2 did not arrive at all_reduce" in text, text
        assert "rank 1 raised because of it" in text, text
        assert "rank 0 waits in all_reduce" in text, text
        store = _get_default_store()
        # the witness (rank 0) raised first; its wall clock is in the store
        assert store.check([RAISED_AT + "0"]), "rank 0 has not raised yet"
        assert float(store.get(RAISED_AT + "0").decode()) < time.time()
    else:
        assert "[2] did not arrive" in text, text
        _get_default_store().set(RAISED_AT + str(me), str(time.time()))
        time.sleep(1.0)  # the store's host stays while rank 1 reads it
