"""Fault bodies for the multi-process safety tests (``test_safety.py``), as a new user
meets them: a rank skips a collective, calls another one, stalls, dies or is killed.

Each body runs on every rank of a Gloo world started with ``timeout_s=TIMEOUT_S``.
Ranks that must raise call :func:`expect_error`, which checks that the error is a
``CollectiveError`` that came within the timeout plus slack and whose message names
what it must (the collective, the differing field, the absent rank).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import shardwise as sw
import shardwise.distributed as sd
from shardwise import DeviceMesh, Partial, PlacementMapping, Replicated, Sharded, lax
from shardwise.distributed import CollectiveError, process_index

TIMEOUT_S = 5.0
SLACK_S = 5.0   # naming the absent ranks reads the store for up to 2 s; a loaded machine


def expect_error(fn: Callable[[], Any], *needles: str) -> str:
    """``fn()`` must raise CollectiveError within the timeout + slack, naming ``needles``."""
    start = time.monotonic()
    try:
        fn()
    except CollectiveError as err:
        elapsed = time.monotonic() - start
        text = str(err)
        assert elapsed < TIMEOUT_S + SLACK_S, f"the error came after {elapsed:.1f} s: {text}"
        for needle in needles:
            assert needle in text, f"{needle!r} not in: {text}"
        return text
    raise AssertionError("the collective returned although a peer skipped/mismatched/died")


def pm(mesh: DeviceMesh, *placements: Any) -> PlacementMapping:
    return PlacementMapping(mesh, list(placements))


def line(n: int) -> DeviceMesh:
    return DeviceMesh.cpu((n,), ("x",))


def square(n: int, s: Any) -> Any:
    """A 4n x 4n tensor laid out by ``s`` on the 1-D mesh."""
    return sw.tensor(torch.arange(16.0 * n * n).reshape(4 * n, 4 * n), sharding=pm(line(n), s))


# --- item 1: disagreements raise on every rank, naming the field -------------------------
def body_all_gather_other_dim(n: int) -> None:
    """Equal sizes, different layouts: rank 0 gathers rows, the others columns."""
    rows, cols = square(n, Sharded(0)), square(n, Sharded(1))
    sw.all_gather(rows), sw.all_gather(cols)  # both work when everyone agrees
    mine = rows if process_index() == 0 else cols
    expect_error(lambda: sw.all_gather(mine), "all_gather", "layout", "rank 0")
    # nothing was exchanged and every rank raised: the world still works
    assert torch.equal(sw.all_gather(rows).to_torch(), rows.to_torch())


def body_all_reduce_shapes(n: int) -> None:
    """(8, 8) on rank 0, (16, 8) elsewhere: an error, not a SIGABRT inside Gloo; also
    small against large (one message carries data, the other only the header)."""
    mesh = line(n)
    for other in ((16, 8), (512, 8)):
        shape = (8, 8) if process_index() == 0 else other
        p = sw.from_local([torch.ones(shape) if k == process_index() else None
                           for k in range(n)], pm(mesh, Partial()), shape=shape)
        expect_error(lambda p=p: sw.all_reduce(p), "all_reduce", "shape", "(8, 8)")
    big = (600, 8) if process_index() == 0 else (700, 8)
    q = sw.from_local([torch.ones(big) if k == process_index() else None for k in range(n)],
                      pm(mesh, Partial()), shape=big)
    expect_error(lambda: sw.all_reduce(q), "all_reduce", "shape")


def body_all_reduce_ops(n: int) -> None:
    """sum on rank 0, max (then avg, min) on the others, same size: both raise (no 2.5)."""
    mesh = line(n)
    p = sw.from_local([torch.full((4, 2), 1.0 + k) if k == process_index() else None
                       for k in range(n)], pm(mesh, Partial()), shape=(4, 2))
    for other in ("max", "avg", "min"):
        op = "sum" if process_index() == 0 else other
        expect_error(lambda op=op: sw.all_reduce(p, reduce_op=op), "reduce op", "sum", other)
    lo = "min" if process_index() == 0 else "max"  # neither sum: the max/-min check
    expect_error(lambda: sw.all_reduce(p, reduce_op=lo), "reduce op")
    big = sw.from_local([torch.ones(1024, 8) if k == process_index() else None
                         for k in range(n)], pm(mesh, Partial()), shape=(1024, 8))
    op = "sum" if process_index() == 0 else "max"
    expect_error(lambda: sw.all_reduce(big, reduce_op=op), "reduce op")
    assert torch.equal(sw.all_reduce(p).to_torch(), torch.full((4, 2), n * (n + 1) / 2))


def body_dtypes(n: int) -> None:
    mesh = line(n)
    dtype = torch.float32 if process_index() == 0 else torch.float64
    p = sw.from_local([torch.ones(4, 2, dtype=dtype) if k == process_index() else None
                       for k in range(n)], pm(mesh, Partial()), shape=(4, 2))
    expect_error(lambda: sw.all_reduce(p), "dtype", "float32", "float64")


def body_other_collective(n: int) -> None:
    """all_gather on rank 0 against all_to_all elsewhere (different message sizes)."""
    t = square(n, Sharded(0))
    if process_index() == 0:
        expect_error(lambda: sw.all_gather(t), "collective", "all_gather", "all_to_all")
    else:
        expect_error(lambda: sw.all_to_all(t, 1, 0), "all_to_all")


def body_reduce_scatter_vs_all_reduce(n: int) -> None:
    """Both travel in the control message when small: still told apart, both raise."""
    p = sw.tensor(torch.ones(2 * n, 2), sharding=pm(line(n), Partial()))
    fn = (lambda: sw.reduce_scatter(p, 0)) if process_index() == 0 else \
        (lambda: sw.all_reduce(p))
    expect_error(fn, "collective: ", "reduce_scatter", "all_reduce")
    assert torch.equal(sw.reduce_scatter(p, 0).to_torch(), torch.ones(2 * n, 2))  # global value


def body_lax_mismatch(n: int) -> None:
    """shard_map's process collectives: psum against pmax, gather axis 0 against 1."""
    mesh = line(n)
    x = sw.tensor(torch.ones(4 * n, 4), sharding=pm(mesh, Sharded(0)))

    def fn(a: torch.Tensor) -> torch.Tensor:
        return lax.psum(a, "x") if process_index() == 0 else lax.pmax(a, "x")

    expect_error(lambda: sw.shard_map(fn, mesh, in_specs=(("x", None),),
                                      out_specs=(None, None))(x), "reduce op")

    def gather(a: torch.Tensor) -> torch.Tensor:
        square_block = a[:, :4].reshape(4, 4)
        return lax.all_gather(square_block, "x", axis=process_index() % 2 if n > 1 else 0,
                              tiled=True)

    expect_error(lambda: sw.shard_map(gather, mesh, in_specs=(("x", None),),
                                      out_specs=(None, None))(x), "dim")


def _gloo_calls(fn: Callable[[], Any]) -> int:
    """How many Gloo calls ``fn`` makes: messages (``agreement._post``) and data."""
    from shardwise.runtime.process import agreement

    targets = [(dist, name) for name in ("all_reduce", "batch_isend_irecv",
                                         "all_to_all_single", "broadcast")]
    targets.append((agreement, "_post"))
    saved = [(mod, name, getattr(mod, name)) for mod, name in targets]
    count = [0]

    def counting(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return real(*args, **kwargs)
        return call

    try:
        for mod, name, real in saved:
            setattr(mod, name, counting(real))
        fn()
    finally:
        for mod, name, real in saved:
            setattr(mod, name, real)
    return count[0]


def body_learned_room(n: int) -> None:
    """A repeated step of medium collectives (2048 elements, above the fixed room of a
    control message) and a large all_reduce (32768 elements, above CAP): once the
    group has seen the step, each travels in one Gloo call (medium ones inside the
    control message, the large one as its data with the tail appended). Disagreements
    about them still raise on every rank (a skip, another shape, another op, one above
    CAP), never a Gloo size abort, and the next steps are exact again."""
    mesh, me = line(n), process_index()

    def partial(local: torch.Tensor) -> Any:
        return sw.from_local([local if k == me else None for k in range(n)],
                             pm(mesh, Partial()), shape=tuple(local.shape))

    x = torch.arange(2048.0).reshape(64, 32)
    y = torch.arange(32768.0).reshape(256, 128) % 97
    p, big = partial(x + me), partial(y * (me + 1))
    total, big_total = sum(x + k for k in range(n)), y * (n * (n + 1) // 2)
    g = sw.tensor(x, sharding=pm(mesh, Sharded(0)))  # uneven over 3 ranks

    def step() -> None:
        assert torch.equal(sw.all_reduce(p).to_torch(), total)
        assert torch.equal(sw.all_gather(g).to_torch(), x)
        assert torch.equal(sw.all_reduce(big).to_torch(), big_total)

    assert _gloo_calls(step) == 6  # not learned yet: a header, then the data
    step(), step()
    assert _gloo_calls(step) == 3  # learned: the data rides in the messages
    assert _gloo_calls(lambda: sw.all_reduce(p)) == 1
    expect_error(lambda: sw.all_gather(g) if me == n - 1 else sw.all_reduce(p),
                 "collective: ", "all_reduce", "all_gather", f"rank {n - 1}")
    step(), step(), step()
    for other in ((32, 32), (1024, 32)):   # fits the room / above CAP
        shape = (64, 32) if me == 0 else other
        q = partial(torch.ones(shape))
        expect_error(lambda q=q: sw.all_reduce(q), "all_reduce", "shape", "(64, 32)")
        step(), step(), step()
    # the large one: another collective, another op, another shape of the same size
    sw.all_reduce(p), sw.all_gather(g)  # next: the fused all_reduce
    expect_error(lambda: sw.all_reduce(big) if me == 0 else sw.all_gather(g), "collective: ")
    step(), step(), step()
    sw.all_reduce(p), sw.all_gather(g)
    op = "sum" if me == 0 else "max"
    expect_error(lambda: sw.all_reduce(big, reduce_op=op), "reduce op", "sum", "max")
    step(), step(), step()
    sw.all_reduce(p), sw.all_gather(g)
    other_big = big if me == 0 else partial(torch.ones(512, 64))
    expect_error(lambda: sw.all_reduce(other_big), "shape", "(256, 128)", "(512, 64)")
    step(), step(), step()
    assert _gloo_calls(step) == 3


def body_group_creation_mismatch(n: int) -> None:
    """2x2 mesh: the first all_gather over dp on ranks 0 and 1, over tp on 2 and 3.
    Creating the process groups is matched by call order, so it agrees first."""
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    t = sw.tensor(torch.arange(64.0).reshape(8, 8), sharding=pm(mesh, Sharded(0), Sharded(1)))
    dim = 0 if process_index() < 2 else 1
    expect_error(lambda: sw.all_gather(t, dim), "create process groups", "group",
                 "('dp',)", "('tp',)")


def body_group_warm_other_axis(n: int) -> None:
    """2x2 mesh, groups already made: ranks 0 and 1 gather over dp, 2 and 3 over tp.
    Ranks 0 and 1 wait for partners that never come: bounded, naming the absent rank;
    ranks 2 and 3 agree among themselves and get the correct tp gather."""
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    x = torch.arange(64.0).reshape(8, 8)
    t = sw.tensor(x, sharding=pm(mesh, Sharded(0), Sharded(1)))
    sw.all_gather(t, 0), sw.all_gather(t, 1)
    if process_index() < 2:
        expect_error(lambda: sw.all_gather(t, 0), "all_gather", "timed out", "did not arrive",
                     f"[{process_index() + 2}]")
    else:
        out = sw.all_gather(t, 1)
        r = process_index()
        assert torch.equal(out.shards[r], x[4 * (r // 2): 4 * (r // 2) + 4]), out.shards[r]
        time.sleep(TIMEOUT_S + SLACK_S)  # stay alive while the others time out


# --- item 2: every wait is bounded ---------------------------------------------------------
def _absent(n: int) -> int:
    return n - 1


def body_skip_all_gather_stay_alive(n: int) -> None:
    """The last rank skips an all_gather (a data-dependent branch) and stays alive."""
    t = square(n, Sharded(0))
    sw.all_gather(t)
    if process_index() == _absent(n):
        time.sleep(TIMEOUT_S + SLACK_S + 1)
        return
    expect_error(lambda: sw.all_gather(t), "all_gather", "timed out",
                 f"[{_absent(n)}] did not arrive")
    start = time.monotonic()  # the group is refused from now on, at once
    expect_error(lambda: sw.all_gather(t), "failed earlier")
    assert time.monotonic() - start < 1.0


def body_skip_then_next(n: int) -> None:
    """The last rank skips an all_gather and goes on to an all_reduce: every rank raises
    at once, naming both collectives."""
    t = square(n, Sharded(0))
    p = sw.tensor(torch.ones(4, 2), sharding=pm(line(n), Partial()))
    sw.all_gather(t)
    fn = (lambda: sw.all_reduce(p)) if process_index() == _absent(n) else \
        (lambda: sw.all_gather(t))
    expect_error(fn, "collective: ", "all_reduce", "all_gather", f"rank {_absent(n)}")


def body_stall(n: int) -> None:
    """The last rank stalls past the timeout before an all_reduce; the others raise in
    time naming it, and it raises too when it comes back."""
    p = sw.tensor(torch.ones(4, 2), sharding=pm(line(n), Partial()))
    sw.all_reduce(p)
    if process_index() == _absent(n):
        time.sleep(TIMEOUT_S + SLACK_S)
        expect_error(lambda: sw.all_reduce(p), "all_reduce")
    else:
        expect_error(lambda: sw.all_reduce(p), "all_reduce", "timed out",
                     f"[{_absent(n)}] did not arrive")


def body_stall_late_member(n: int) -> None:
    """As body_stall, and rank 1 reaches the all_reduce a second after rank 0, the
    store's host: rank 0 names the absent rank first, and rank 1, timing out later,
    names it too (rank 0 waits for it before leaving with the store, bounded; it once
    left and rank 1's error lost the name)."""
    p = sw.tensor(torch.ones(4, 2), sharding=pm(line(n), Partial()))
    sw.all_reduce(p)
    if process_index() == _absent(n):
        time.sleep(TIMEOUT_S + SLACK_S)
        expect_error(lambda: sw.all_reduce(p), "all_reduce")
        return
    if process_index() == 1:
        time.sleep(1.0)
    expect_error(lambda: sw.all_reduce(p), "all_reduce", "timed out",
                 f"[{_absent(n)}] did not arrive")


def _die(how: str) -> None:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(17)


def _dies(n: int, how: str, fn: Callable[[], Any], *needles: str) -> None:
    fn()  # everyone healthy: warm up
    if process_index() == _absent(n):
        _die(how)
    expect_error(lambda: [fn() for _ in range(3)], *needles)


def body_killed_all_reduce(n: int) -> None:
    p = sw.tensor(torch.ones(8, 8), sharding=pm(line(n), Partial()))
    _dies(n, "kill", lambda: sw.all_reduce(p), "all_reduce")


def body_dead_all_reduce_large(n: int) -> None:
    p = sw.tensor(torch.ones(1024, 64), sharding=pm(line(n), Partial()))
    _dies(n, "exit", lambda: sw.all_reduce(p), "all_reduce")


def body_dead_ppermute(n: int) -> None:
    t = square(n, Sharded(0))
    ring = [(i, (i + 1) % n) for i in range(n)]
    _dies(n, "kill", lambda: sw.ppermute(t, ring), "ppermute")


def body_dead_barrier(n: int) -> None:
    _dies(n, "exit", lambda: sd.barrier(), "barrier")


def body_skip_barrier(n: int) -> None:
    sd.barrier()
    if process_index() == _absent(n):
        time.sleep(TIMEOUT_S + SLACK_S + 1)
        return
    expect_error(sd.barrier, "barrier", "timed out", f"[{_absent(n)}] did not arrive")


def body_skip_ppermute(n: int) -> None:
    """Point-to-point waits have no timeout in Gloo itself; ours do."""
    t = square(n, Sharded(0))
    ring = [(i, (i + 1) % n) for i in range(n)]
    sw.ppermute(t, ring)
    if process_index() == _absent(n):
        time.sleep(TIMEOUT_S + SLACK_S + 1)
        return
    expect_error(lambda: sw.ppermute(t, ring), "ppermute", "timed out")


def body_skip_lax_psum(n: int) -> None:
    """shard_map's process collectives: the last rank's fn skips its psum, so its next
    collective (assembling the outputs) meets the others' psum: all raise at once."""
    mesh = line(n)
    x = sw.tensor(torch.ones(4 * n, 4), sharding=pm(mesh, Sharded(0)))

    def fn(a: torch.Tensor) -> torch.Tensor:
        return a if process_index() == _absent(n) else lax.psum(a, "x")

    run = sw.shard_map(fn, mesh, in_specs=(("x", None),), out_specs=("x", None))
    expect_error(lambda: run(x), "collective: ", "all_reduce", f"rank {_absent(n)}")


def body_dead_lax_ppermute(n: int) -> None:
    mesh = line(n)
    x = sw.tensor(torch.ones(4 * n, 4), sharding=pm(mesh, Sharded(0)))
    ring = [(i, (i + 1) % n) for i in range(n)]
    run = sw.shard_map(lambda a: lax.ppermute(a, "x", ring), mesh, in_specs=(("x", None),),
                       out_specs=("x", None))
    _dies(n, "kill", lambda: run(x), "ppermute")


# --- teardown: shutdown() releases every process group ------------------------------------
def body_shutdown_releases_groups(n: int) -> None:
    """After shutdown() nothing but the caller holds the groups shardwise used, so their
    Gloo threads stop then, not in interpreter finalization (where one dropping a
    tensor aborts the process: "terminate called without an active exception")."""
    import gc
    import sys

    from shardwise.runtime.process.world import WORLD

    mesh = DeviceMesh.cpu((2, n // 2), ("a", "b"))
    x = torch.arange(16.0 * n).reshape(4 * n, 4)
    t = sw.tensor(x, sharding=pm(mesh, Sharded(0), Replicated()))
    for axes in ("a", "b", ("a", "b")):
        p = sw.tensor(x, sharding=pm(mesh, Partial(), Partial()))
        sw.all_reduce(p, reduce_axes=axes)
    assert torch.equal(sw.all_gather(t).to_torch(), x)
    pgs = list({id(pg): pg for pg in [dist.group.WORLD, *(g.pg for g in WORLD.groups.values())]
                }.values())
    assert len(pgs) == 3, pgs  # the world (also the group of both axes) and one per axis
    sd.shutdown()
    del t, p, mesh
    gc.collect()
    held = [sys.getrefcount(pg) - 3 for pg in pgs]  # the list's, the loop's, the call's
    assert held == [0] * len(pgs), f"references to the process groups left: {held}"
