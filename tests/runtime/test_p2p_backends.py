"""The point-to-point layer's backend choices, without processes or a GPU (torch's
calls faked): where messages live, when every stream needs its own process group and
how many (NCCL ignores tags), the refusals of backends it cannot run on, and the
bounded host-side wait of an NCCL work."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise import DeviceMesh
from shardwise.pipelining import stage
from shardwise.runtime.process import agreement, diagnose, groups, p2p
from shardwise.runtime.process.world import WORLD
from shardwise.sharding.errors import CollectiveError, ShardingError
from tests.helpers.fake_world import clean_world


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A fake world: rank 0 of ``state["size"]``, backend ``state["backend"]``; every
    group created is recorded (sorted ranks) and is a new object."""
    state: dict[str, Any] = {"backend": "gloo", "size": 8, "made": [], "timeouts": []}

    def new_group(ranks: list[int], timeout: Any = None) -> object:
        state["made"].append(tuple(ranks))
        return object()

    monkeypatch.setattr(dist, "get_backend", lambda group=None: state["backend"])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: state["size"])
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout",
                        lambda timeout, pg: state["timeouts"].append((timeout, pg)))
    monkeypatch.setattr(agreement, "agree", lambda *args, **kwargs: None)
    with clean_world():
        yield state


def test_messages_live_on_this_gpu_with_nccl_and_on_the_cpu_with_gloo(
        world: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    assert p2p.message_device() == torch.device("cpu")
    world["backend"] = "nccl"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert p2p.message_device() == torch.device("cuda", 3)


def test_streams_need_their_own_groups_on_nccl_or_with_the_hook(
        world: dict[str, Any]) -> None:
    assert not p2p.needs_stream_groups()
    WORLD.force_stream_groups = True
    assert p2p.needs_stream_groups()
    WORLD.force_stream_groups = False
    world["backend"] = "nccl"
    assert p2p.needs_stream_groups()


def test_backends_it_cannot_run_on_are_refused(world: dict[str, Any],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    assert p2p.check_backend("X") == "gloo"
    world["backend"] = "mpi"
    with pytest.raises(ShardingError, match=r"X runs on Gloo or NCCL; this run's backend "
                                            r"is 'mpi'. Initialize with backend='gloo'"):
        p2p.check_backend("X")
    world["backend"] = "nccl"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ShardingError, match=r"'nccl'.*torch.cuda.is_available\(\) is False.*"
                                            r"backend='gloo'"):
        p2p.check_backend("X")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ShardingError, match=r"this torch build has no NCCL.*"
                                            r"is_nccl_available\(\) is False"):
        p2p.check_backend("X")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert p2p.check_backend("X") == "nccl"


def _stages(shape: tuple[int, ...], names: tuple[str, ...], v: int, style: str
            ) -> tuple[DeviceMesh, list[DeviceMesh]]:
    mesh = DeviceMesh.cpu(shape, names)
    p = mesh.axis_size("pp")
    return mesh, [stage._stage_mesh(mesh, "pp", stage._rank(s, p, style)) for s in range(p * v)]


# (mesh, stages per rank, style) -> (groups prepare_stage_groups creates without and
# with a group per stream); 2x2x2: the parent mesh's 18 groups (every sorted subset of
# axes), then 2 directions x 4 coordinates per pair of adjacent stages on two ranks
LAYOUTS = [((2, 2, 2), ("pp", "dp", "tp"), 1, "loop", 18, 26),   # 1F1B
           ((2, 2, 2), ("pp", "dp", "tp"), 2, "loop", 18, 42),   # interleaved
           ((2, 2, 2), ("pp", "dp", "tp"), 2, "v", 18, 34),      # ZBV: stages 1, 2 on rank 1
           ((4,), ("pp",), 1, "loop", 0, 6),
           ((4,), ("pp",), 2, "loop", 0, 14),
           ((4,), ("pp",), 2, "v", 0, 12)]


@pytest.mark.parametrize(("shape", "names", "v", "style", "without", "with_streams"),
                         LAYOUTS)
def test_one_group_per_stream_on_nccl_none_on_gloo(
        world: dict[str, Any], shape: tuple[int, ...], names: tuple[str, ...], v: int,
        style: str, without: int, with_streams: int) -> None:
    world["size"] = math.prod(shape)
    mesh, stages = _stages(shape, names, v, style)
    groups.prepare_stage_groups(mesh, "pp", stages)
    assert len(world["made"]) == without and not WORLD.streams
    WORLD.reset()
    world["made"].clear()
    world["backend"] = "nccl"
    groups.prepare_stage_groups(mesh, "pp", stages)
    assert len(world["made"]) == with_streams
    pairs = groups.stream_pairs(stages)
    assert list(WORLD.streams) == pairs and len(set(pairs)) == len(pairs)
    assert world["made"][without:] == [tuple(sorted(k[:2])) for k in pairs]
    # every stream its own group, even between the same two ranks (interleaved)
    assert len({id(g) for g in WORLD.streams.values()}) == len(pairs)
    # rank 0's groups (NCCL) wait through the pause between steps: the watchdog's long
    # timeout; p2p bounds each wait itself
    mine = [WORLD.streams[k] for k in pairs if 0 in k[:2]]
    assert [pg for _, pg in world["timeouts"]] == mine
    # a second pipeline on the same stages makes none
    groups.prepare_stage_groups(mesh, "pp", stages)
    assert len(world["made"]) == with_streams


def test_the_stream_layout_of_pp2_x_tp2() -> None:
    mesh = DeviceMesh.cpu((2, 2), ("pp", "tp"))
    stages = [mesh.submesh(pp=0), mesh.submesh(pp=1)]
    up, down = p2p.stream_tag(0, 1), p2p.stream_tag(1, 0)
    assert groups.stream_pairs(stages) == [(0, 2, up), (1, 3, up), (2, 0, down), (3, 1, down)]
    # interleaved: three streams from rank 0 to rank 2 (stages 0 -> 1, 2 -> 1, 2 -> 3)
    inter = groups.stream_pairs(stages * 2)
    assert [k for k in inter if k[:2] == (0, 2)] == [
        (0, 2, up), (0, 2, p2p.stream_tag(2, 1)), (0, 2, p2p.stream_tag(2, 3))]


class _Work:
    """An NCCL work that completes after ``polls`` polls (never when None)."""

    def __init__(self, polls: int | None) -> None:
        self.polls, self.waited = polls, False

    def is_completed(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def wait(self, timeout: Any = None) -> bool:
        assert timeout is None, "an NCCL wait with a timeout counts from the enqueue"
        self.waited = True
        return True


def test_an_nccl_wait_polls_then_orders_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    work = _Work(3)
    stream = p2p._Stream(torch.device("cuda", 0))
    p2p._wait(work, time.monotonic() + 5.0, stream, lambda: "w")
    assert work.waited and work.polls == -1


def test_an_nccl_wait_is_bounded_from_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diagnose, "record", lambda text: "")
    monkeypatch.setattr(WORLD, "timeout_s", 0.2)
    stream = p2p._Stream(torch.device("cuda", 0))
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=r"^w timed out after 0\.\d s "
                                              r"\(timeout_s=0\.2\): the peer stalled"):
        p2p._wait(_Work(None), start + 0.2, stream, lambda: "w")
    assert 0.2 <= time.monotonic() - start < 1.0
    assert stream.failed  # the stream refuses from now on
    with pytest.raises(CollectiveError, match="this stream failed earlier"):
        p2p._refuse(stream, lambda: "next")


class _Loopback:
    """A process group whose sends land in a queue per tag and whose receives take
    from it (a rank talking to itself); every posted receive is counted."""

    def __init__(self) -> None:
        self.queues: dict[int, list[torch.Tensor]] = {}
        self.posted = 0

    def send(self, bufs: list[torch.Tensor], dst: int, tag: int) -> Any:
        self.queues.setdefault(tag, []).append(bufs[0].view(torch.uint8).clone())
        return _Done(lambda: None)

    def recv(self, bufs: list[torch.Tensor], src: int, tag: int) -> Any:
        self.posted += 1

        def land() -> None:
            got = self.queues[tag].pop(0)
            into = bufs[0].view(torch.uint8)   # (Gloo moves bytes; a receive may be typed)
            assert got.numel() == into.numel(), "a message paired with another size"
            into.copy_(got)
        return _Done(land)


class _Done:
    def __init__(self, on_wait: Any) -> None:
        self.on_wait = on_wait

    def wait(self, timeout: Any = None) -> bool:
        self.on_wait()
        return True


@pytest.fixture
def pg(world: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> _Loopback:
    """The fake world's default group: a loopback (this rank talking to itself)."""
    loop = _Loopback()
    monkeypatch.setattr(p2p, "_pg", lambda group: loop)
    return loop


def test_gloo_posts_the_next_receive_before_it_waits_and_overflows_on_its_own_tag(
        pg: _Loopback) -> None:
    small = torch.arange(6.0).reshape(2, 3)
    big = torch.arange(3000, dtype=torch.int32)   # 12 KB: more than a first message holds
    p2p.send_parts({"n": 0}, [small], 1, 7, "F0")
    p2p.send_parts({"n": 1}, [big], 1, 7, "F1")
    p2p.send_parts({"n": 2}, [small * 2], 1, 7, "F2")
    info, (got,) = p2p.recv_parts(1, 7, "F0")
    assert info == {"n": 0} and torch.equal(got, small)
    # this message's receive and the next's were posted before the wait; none after it
    assert pg.posted == 2 and len(p2p._stream(1, 7, "recv", None).ahead) == 1
    # the next message is F1's header (its payload follows alone, on the overflow tag,
    # which the receive posted ahead for F2 does not take)
    info, (got,) = p2p.recv_parts(1, 7, "F1")
    assert info == {"n": 1} and torch.equal(got, big) and got.dtype == torch.int32
    assert pg.posted == 4 and not pg.queues[7 + p2p._OVERFLOW]
    info, (got,) = p2p.recv_parts(1, 7, "F2")
    assert info == {"n": 2} and torch.equal(got, small * 2)
    # both ends sized the messages alike: F3's is F1's size (two transfers before)
    assert p2p._stream(1, 7, "send", None).caps == p2p._stream(1, 7, "recv", None).caps
    assert p2p._stream(1, 7, "recv", None).caps[0] >= big.numel() * 4


def test_a_sent_message_is_reused_only_after_flush_waited_for_it(
        pg: _Loopback) -> None:
    a = torch.arange(6.0).reshape(2, 3)
    p2p.send_parts(None, [a], 1, 7, "F0")
    stream = p2p._stream(1, 7, "send", None)
    (_, (first, _), _), = stream.sends
    p2p.send_parts(None, [a + 1], 1, 7, "F1")   # not flushed: a new buffer
    second = stream.sends[1][1][0]
    assert second is not first
    p2p.flush()
    p2p.send_parts(None, [a + 2], 1, 7, "F2")
    (_, (third, _), _), = stream.sends
    assert third is first or third is second   # sent and waited for: reused
    for i in range(3):
        _, (got,) = p2p.recv_parts(1, 7, f"F{i}")
        assert torch.equal(got, a + i)


def test_a_new_world_starts_with_new_streams(world: dict[str, Any]) -> None:
    old = p2p._stream(1, 7, "recv", None)
    old.seq = 5
    assert p2p._stream(1, 7, "recv", None) is old
    WORLD.reset()   # what shutdown() and initialize() do
    new = p2p._stream(1, 7, "recv", None)
    assert new is not old and new.seq == 0 and not new.ahead


@pytest.mark.parametrize("name", ["nn", "no_such_dtype", "Tensor"])
def test_a_description_this_version_does_not_write_is_a_collective_error(
        pg: _Loopback, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(diagnose, "record", lambda text: "")
    monkeypatch.setitem(p2p._DTYPE_NAMES, torch.float32, name)  # what a peer might write
    p2p.send_parts(None, [torch.ones(3)], 1, 7, "F0")
    with pytest.raises(CollectiveError, match=r"receive of F0 from rank 1: the peer's "
                                              r"description of the transfer is not one"):
        p2p.recv_parts(1, 7, "F0")
    with pytest.raises(CollectiveError, match="this stream failed earlier"):
        p2p.recv_parts(1, 7, "F1")


@pytest.mark.parametrize("shape", ["[3.5]", "[-3]", "[\"3\"]"])
def test_a_description_with_a_shape_no_tensor_has_is_a_collective_error(
        pg: _Loopback, monkeypatch: pytest.MonkeyPatch, shape: str) -> None:
    import json
    import types

    monkeypatch.setattr(diagnose, "record", lambda text: "")
    # what a peer might write: the tensor's shape [3] replaced
    monkeypatch.setattr(p2p, "json", types.SimpleNamespace(
        dumps=lambda obj: json.dumps(obj).replace('"float32", [3]', f'"float32", {shape}'),
        loads=json.loads))
    p2p.send_parts(None, [torch.ones(3)], 1, 7, "F0")
    with pytest.raises(CollectiveError, match=r"the peer's description of the transfer is "
                                              r"not one this version writes"):
        p2p.recv_parts(1, 7, "F0")


def test_a_receive_posted_ahead_holds_its_tensors_typed_or_as_bytes(
        pg: _Loopback) -> None:
    a = torch.arange(6.0).reshape(2, 3)
    flags = [torch.tensor([True, False, True]), torch.zeros(0, 4, dtype=torch.bool),
             torch.tensor(True)]                     # one dtype, a size-0 and a 0-dim one
    mixed = [torch.arange(4.0, dtype=torch.float64) * (1 + 2j), torch.arange(3, dtype=torch.int8)]
    sent = [[a], [a + 1], [a + 2], flags, flags, flags, mixed, mixed, mixed, [a.t() * 1]]
    for i, ts in enumerate(sent):
        p2p.send_parts(i, ts, 1, 7, f"F{i}")
    stream = p2p._stream(1, 7, "recv", None)
    for i, ts in enumerate(sent):
        info, got = p2p.recv_parts(1, 7, f"F{i}")
        assert info == i and len(got) == len(ts)
        for x, want in zip(got, ts, strict=True):
            assert x.dtype == want.dtype and x.shape == want.shape and torch.equal(x, want)
            assert x.is_contiguous() and not x.requires_grad
        if len(got) > 1:   # copies: an in-place write to one leaves the others' versions
            got[0].add_(1) if got[0].dtype != torch.bool else got[0].logical_not_()
            assert all(x._version == 0 for x in got[1:])
        if i == 1:   # F2's receive, posted with F0's description: float32, F2's view made
            (_, message, _, made), = stream.ahead
            assert message.dtype == torch.float32 and made[1][0].shape == (2, 3)
        if i == 7:   # mixed dtypes: the message stays bytes
            assert stream.ahead[0][1].dtype == torch.uint8


def test_a_host_sender_yields_its_core_after_each_message(
        pg: _Loopback, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(p2p, "_yield", lambda: calls.append(pg.posted))
    p2p.send_parts(None, [torch.ones(3)], 1, 7, "F0")
    p2p.send_parts(None, [torch.ones(5000)], 1, 7, "F1")   # a payload of its own: still one
    assert calls == [0, 0]
    for i, n in enumerate((3, 5000)):
        _, (got,) = p2p.recv_parts(1, 7, f"F{i}")
        assert torch.equal(got, torch.ones(n))
    assert len(calls) == 2   # receives do not yield
