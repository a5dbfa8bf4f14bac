"""Bodies for the pipeline transport on Gloo ranks: point-to-point transfers of pytrees,
shardwise Tensors crossing stages with their layouts, stage submeshes used by their own
ranks alone, and the faults (a mismatched tag, a dead or stalled peer)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Sharded
from shardwise.distributed import CollectiveError
from shardwise.pipelining.transport_process import ProcessTransport
from shardwise.runtime.process import p2p
from shardwise.runtime.process.groups import group, prepare_stage_groups
from shardwise.runtime.process.world import WORLD
from shardwise.sharding.errors import ShardingError

FAULT_TIMEOUT_S = 3.0   # the timeout the fault launches pass to the harness
FAULT_SLACK_S = 9.0     # naming the culprit through the store, a loaded machine
TIMES = "shardwise-test/pp-fault/"


def _tree(i: int, seed: int | None = None) -> dict[str, object]:
    g = torch.Generator().manual_seed(i if seed is None else seed)
    return {"a": torch.randn(2 + i, 3, generator=g),
            "b": [None, 3, 2.5, "s", torch.arange(i + 1)],
            "c": (torch.tensor([True, False]), torch.empty(0, 4, dtype=torch.float64)),
            "d": torch.randn(5, generator=g).to(torch.bfloat16),
            # larger than the stream's last transfer (a second message), then smaller
            "e": torch.randn((0, 1000, 2000, 100)[i], generator=g),
            # a 0-d tensor, a transposed one, a conjugate view: sent as their values
            "f": (torch.tensor(2.5 + i), torch.randn(3, 2, generator=g).t(),
                  torch.randn(3, dtype=torch.complex64, generator=g).conj())}


def _same(x: object, y: object) -> None:
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and type(y) is torch.Tensor, type(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (x, y)
        assert torch.equal(x, y), (x, y)
        assert not y.requires_grad
    elif isinstance(x, dict):
        assert isinstance(y, dict) and list(x) == list(y), (x, y)
        for k in x:
            _same(x[k], y[k])
    elif isinstance(x, (list, tuple)):
        assert type(x) is type(y) and len(x) == len(y), (x, y)
        for a, b in zip(x, y):
            _same(a, b)
    else:
        assert x == y and type(x) is type(y), (x, y)


def body_p2p_round_trip(n: int) -> None:
    """Ranks 2i -> 2i+1 send trees whose shapes change (growing past the last
    transfer's size, then shrinking) or repeat (a transfer that leaves out the
    description it shares with the previous one), then the receiver sends each back on
    the reverse stream: equal values, dtypes, shapes."""
    me = dist.get_rank()
    peer = me ^ 1
    up, down = p2p.stream_tag(0, 1), p2p.stream_tag(1, 0)
    for step, i in enumerate((0, 1, 1, 2, 2, 1, 3, 3, 0)):
        sent = _tree(i, seed=step)
        if me % 2 == 0:
            p2p.send(sent, peer, up, f"F{step}")
            _same(sent, p2p.recv(peer, down, f"B{step}"))
        else:
            got = p2p.recv(peer, up, f"F{step}")
            _same(sent, got)
            p2p.send(got, peer, down, f"B{step}")
    p2p.flush()
    assert p2p.pending() == 0


def _pp_mesh(n: int) -> DeviceMesh:
    return DeviceMesh.cpu((2, n // 2), ("pp", "tp"))


def body_stage_groups_and_transport(n: int) -> None:
    """pp=2 x tp=2: each stage's ranks run tp collectives on their submesh alone (no
    world collective), an activation sharded over tp crosses from stage 0 to stage 1
    with its layout, and a Partial gradient comes back, with no collective over the
    world; a rank outside a stage mesh that reaches its collective is refused, not
    left waiting."""
    mesh = _pp_mesh(n)
    stages = prepare_stage_groups(mesh, "pp")
    assert stages == [mesh.submesh(pp=0), mesh.submesh(pp=1)]
    me = dist.get_rank()
    stage = me // (n // 2)
    sub = stages[stage]
    # the stage's tp group IS the parent's (found by member ranks, created once)
    assert group(sub, (0,)).pg is group(mesh, (1,)).pg is not None
    world = WORLD.channels.get((id(dist.group.WORLD), "cpu"))
    world_seq = world.seq if world is not None else 0
    full = torch.arange(24.0).reshape(4, 6) + 100 * stage
    x = sw.tensor(full, sharding=PlacementMapping(sub, [Sharded(0)]))
    # a stage alone: gathers and reductions on its own tp group
    assert torch.equal(x.to_torch(), full)
    assert torch.equal(sw.all_gather(x).to_torch(), full)
    t = ProcessTransport(stages)
    for mb in range(2):
        if stage == 0:
            act = sw.tensor(full[:, : 4 + mb], sharding=PlacementMapping(
                sub, [Sharded(1)]), requires_grad=True) * 2
            t.send((act, None, {"n": mb, "plain": torch.ones(mb + 1)}), 0, 1, f"F{mb}")
            grad = t.recv(1, 0, f"B{mb}")
            assert isinstance(grad, sw.Tensor) and grad.mesh == sub
            assert grad.placements == (sw.Partial(),), grad.placements
            want = torch.ones(4, 4 + mb)  # a Partial made from a global value keeps it
            assert torch.equal(grad.to_torch(), want), grad.to_torch()
        else:
            act, none, extra = t.recv(0, 1, f"F{mb}")
            assert none is None and extra["n"] == mb
            assert torch.equal(extra["plain"], torch.ones(mb + 1))
            assert isinstance(act, sw.Tensor) and act.mesh == sub, act
            assert act.placements == (Sharded(1),), act.placements
            assert act.requires_grad and act.is_leaf
            assert torch.equal(act.to_torch(), 2 * torch.arange(24.0).reshape(4, 6)[:, :4 + mb])
            loss = (act * 2).sum()
            loss.backward()
            assert act.grad is not None
            grad = sw.tensor(torch.ones(4, 4 + mb),
                             sharding=PlacementMapping(sub, [sw.Partial()]))
            t.send(grad, 1, 0, f"B{mb}")
    t.flush()
    world = WORLD.channels.get((id(dist.group.WORLD), "cpu"))
    assert (world.seq if world is not None else 0) == world_seq, "a world collective ran"
    other = stages[1 - stage]
    y = sw.tensor(torch.ones(4, 2), sharding=PlacementMapping(other, [Sharded(0)]))
    try:
        sw.all_gather(y)
    except ShardingError as err:
        assert "holds no device of this pipeline stage" in str(err), err
    else:
        raise AssertionError("a collective on another stage's mesh ran on an outsider")
    try:
        t.send(torch.ones(1), 1 - stage, stage, "F9")
    except ShardingError as err:
        assert f"holds no device of stage {1 - stage}" in str(err), err
    else:
        raise AssertionError("sent from a stage this rank does not hold")


# --- faults: each rank records the error's text and how long it took --------------------
def _timed(fn) -> tuple[str, float]:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        fn()
    except CollectiveError as err:
        took = time.monotonic() - start
        assert took < FAULT_TIMEOUT_S + FAULT_SLACK_S, f"after {took:.1f} s: {err}"
        return str(err), took
    raise AssertionError("the transfer returned although its peer failed")


def _report(name: str, text: str, took: float) -> None:
    print(f"FAULT|{name}|rank {dist.get_rank()}|{took:.2f}|{text[:300]}", flush=True)


def _pair(n: int) -> tuple[ProcessTransport, int]:
    mesh = DeviceMesh.cpu((n, 1), ("pp", "x"))
    stages = prepare_stage_groups(mesh, "pp")  # NCCL's layout: a group per stream
    return ProcessTransport(stages), dist.get_rank()


def body_mismatched_tag(n: int) -> None:
    """Stage 0 sends F1 where stage 1 expects F0: stage 1 raises at once naming rank 0,
    both tags and the stages; stage 0 raises when it waits for its gradient."""
    t, me = _pair(n)
    x = torch.ones(3)
    if me == 0:
        t.send(x, 0, 1, "F0")
        t.send(x, 0, 1, "F1")
        text, took = _timed(lambda: t.recv(1, 0, "B0"))
    else:
        assert torch.equal(t.recv(0, 1, "F0"), x)
        text, took = _timed(lambda: t.recv(0, 1, "F0"))
        assert "expected F0 from stage 0 to stage 1 from rank 0" in text, text
        assert "rank 0 sent F1 from stage 0 to stage 1" in text, text
    assert "rank" in text
    _report("mismatched tag", text, took)


def body_dead_peer(n: int) -> None:
    """Stage 1's process dies before receiving: stage 0's wait for its gradient raises
    (the connection closed), naming rank 1, the stages and the tag."""
    t, me = _pair(n)
    t.send(torch.ones(2), 0, 1, "F0") if me == 0 else t.recv(0, 1, "F0")
    if me == 1:
        time.sleep(0.2)
        os._exit(17)
    t.send(torch.ones(2), 0, 1, "F1")
    text, took = _timed(lambda: t.recv(1, 0, "B0"))
    assert "rank 1" in text and "B0 from stage 1 to stage 0" in text, text
    _report("dead peer", text, took)


def body_stalled_peer(n: int) -> None:
    """Stage 1 stalls past the timeout: stage 0's receive raises after the timeout,
    naming rank 1 and the tag; stage 1, waking, finds its stream refused."""
    t, me = _pair(n)
    if me == 1:
        time.sleep(FAULT_TIMEOUT_S + 2.0)
        text, took = _timed(lambda: t.recv(0, 1, "F0"))
        _report("stalled peer (the staller)", text, took)
        return
    text, took = _timed(lambda: t.recv(1, 0, "B0"))
    assert "timed out" in text and "rank 1" in text and "B0" in text, text
    _report("stalled peer", text, took)


def body_shape_disagrees(n: int) -> None:
    """A block whose shape its layout does not give on the receiver: a clear error."""
    mesh = DeviceMesh.cpu((2, n // 2), ("pp", "tp"))
    stages = prepare_stage_groups(mesh, "pp")
    me = dist.get_rank()
    stage = me // (n // 2)
    t = ProcessTransport(stages)
    if stage == 0:
        x = sw.tensor(torch.ones(4, 4), sharding=PlacementMapping(stages[0], [Sharded(0)]))
        from shardwise.runtime.local import Blocks

        x._local = Blocks(tuple(None if s is None else torch.ones(3, 4) for s in x.shards))
        t.send(x, 0, 1, "F0")
        t.flush()
    else:
        try:
            t.recv(0, 1, "F0")
        except CollectiveError as err:
            assert "puts shape (2, 4) here" in str(err), err
        else:
            raise AssertionError("a block of the wrong shape was taken")


# --- the executor on processes: every schedule equals single-device torch -------------
def _schedules() -> dict[str, tuple[object, int, str]]:
    from shardwise import pipelining

    return {"GPipe": (pipelining.ScheduleGPipe, 1, "loop"),
            "1F1B": (pipelining.Schedule1F1B, 1, "loop"),
            "Interleaved1F1B": (pipelining.ScheduleInterleaved1F1B, 2, "loop"),
            "InterleavedZeroBubble": (pipelining.ScheduleInterleavedZeroBubble, 2, "loop"),
            "ZBVZeroBubble": (pipelining.ScheduleZBVZeroBubble, 2, "v")}


def _check_step(pipe, sched, ref, x, t, m, loss, what,  # type: ignore[no-untyped-def]
                clip: bool = False) -> None:
    from shardwise.pipelining.transport import transport_for
    from tests.helpers import pp_models as pm

    transport = transport_for([s.mesh for s in pipe.stages])
    assert type(transport).__name__ == "ProcessTransport", transport
    x0, t0 = x.clone(), t.clone()
    losses: list[object] = []
    out = sched.step(x, target=t, losses=losses)
    assert torch.equal(x, x0) and torch.equal(t, t0), what
    want_losses, want_out = pm.reference(ref, x, t, m, loss)
    if pipe.stages[-1].is_local:
        assert len(losses) == m, (what, losses)
        for i, (a, b) in enumerate(zip(losses, want_losses, strict=True)):
            assert abs(float(pm.values(a)) - b) <= 1e-5 * abs(b), f"{what} mb {i}: {a} vs {b}"
        pm.assert_close(out, want_out, f"{what} output")
    else:
        assert losses == [] and out is None, what
    want = dict(ref.named_parameters())
    got = dict(pipe.named_parameters())
    assert got and set(got) <= set(want), (what, sorted(got))
    for name, p in got.items():
        assert p.grad is not None, f"{what}: {name} has no gradient"
        pm.assert_close(p.grad, want[name].grad, f"{what} grad of {name}")
    if clip:  # the global norm over every stage (reduced over pp), then clipped grads
        from shardwise.pipelining import clip_grad_norm_

        norm = clip_grad_norm_(list(pipe.parameters()), 0.05, pipe=pipe)
        want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        pm.assert_close(norm, want_norm.float(), f"{what} global grad norm")
        for name, p in got.items():
            pm.assert_close(p.grad, want[name].grad, f"{what} clipped grad of {name}")


def body_every_schedule_pp4(n: int) -> None:
    """pp=4 (one device per stage; interleaved and ZBV: two stages per rank), every
    schedule, m in {1, p, 2p, 4p}: losses, output and gradients equal torch's."""
    _schedules_pp4(n, list(_schedules()), (1, n, 2 * n, 4 * n))


def _schedules_pp4(n: int, names: list[str], ms: tuple[int, ...]) -> None:
    import copy

    import torch.nn as nn
    import torch.nn.functional as F

    from shardwise.pipelining import pipeline

    p = n
    for name in names:
        cls, v, style = _schedules()[name]
        stages = p * v
        for m in ms:
            torch.manual_seed(0)
            mods: list[nn.Module] = []
            for _ in range(stages):
                mods += [nn.Linear(8, 8), nn.Tanh()]
            ref = nn.Sequential(*mods)
            pipe = pipeline(copy.deepcopy(ref), DeviceMesh.cpu(p, "pp"),
                            split_points=[str(2 * k) for k in range(1, stages)],
                            stages_per_rank=v, style=style)
            _check_stream_groups(pipe)
            sched = cls(pipe, n_microbatches=m, loss_fn=F.mse_loss)  # type: ignore[operator]
            g = torch.Generator().manual_seed(m)
            x, t = torch.randn(m + 1, 8, generator=g), torch.randn(m + 1, 8, generator=g)
            _check_step(pipe, sched, ref, x, t, m, F.mse_loss, f"{name} p={p} m={m}")


def body_structured_values_pp4(n: int) -> None:
    """pp=4, GPipe and 1F1B: stage values other than one tensor cross processes (a
    tuple with an int tensor, a dict with a value leaf, a tuple of two tensors); losses
    and gradients equal torch's."""
    import copy

    import torch.nn.functional as F

    from shardwise.pipelining import pipeline
    from tests.helpers import pp_models as pm

    for name in ("GPipe", "1F1B"):
        cls, _, _ = _schedules()[name]
        mods = pm.structured_stages(8)
        ref = copy.deepcopy(mods)
        pipe = pipeline(mods, DeviceMesh.cpu(n, "pp"))
        m = 4
        sched = cls(pipe, n_microbatches=m, loss_fn=F.mse_loss)  # type: ignore[operator]
        g = torch.Generator().manual_seed(1)
        x, t = torch.randn(2 * m, 8, generator=g), torch.randn(2 * m, 8, generator=g)
        losses: list[object] = []
        sched.step(x, target=t, losses=losses)
        pm.check_structured(pipe, ref, x, t, m, F.mse_loss, losses, name)


def body_every_schedule_pp2_tp2(n: int) -> None:
    """pp=2 x tp=2: a GPT whose stages are tensor-parallel on their stage mesh (the
    activations cross as tp-laid-out Tensors), every schedule, m in {1, p, 2p, 4p};
    at m = 2p also clip_grad_norm_ over every stage equals torch's."""
    _schedules_pp2_tp2(n, list(_schedules()), (1, 2, 4, 8))


def _schedules_pp2_tp2(n: int, names: list[str], ms: tuple[int, ...]) -> None:
    import copy

    from shardwise.parallel import parallelize_module
    from shardwise.pipelining import pipeline
    from tests.helpers import pp_models as pm

    assert n == 4
    p = 2
    mesh = DeviceMesh.cpu((2, 2), ("pp", "tp"))
    for name in names:
        cls, v, style = _schedules()[name]
        layers = p * v
        for m in ms:
            ref = pm.make(layers)
            pipe = pipeline(copy.deepcopy(ref), mesh,
                            split_points=[f"layers.{k}" for k in range(1, layers)],
                            stages_per_rank=v, style=style)
            _check_stream_groups(pipe)
            for st in pipe.local_stages:
                parallelize_module(st.module, st.mesh, pm.plan_for(st.module))
            x, t = pm.batch(pm.config(layers), m)
            sched = cls(pipe, n_microbatches=m, loss_fn=pm.loss_fn)  # type: ignore[operator]
            _check_step(pipe, sched, ref, x, t, m, pm.loss_fn, f"{name} pp2xtp2 m={m}",
                        clip=m == 2 * p)


def _check_stream_groups(pipe) -> None:  # type: ignore[no-untyped-def]
    """With the stream-group hook (NCCL's layout), every stream of the pipe has its own
    two-rank group and the transport uses them; without it, no stream group exists."""
    from shardwise.pipelining.transport import transport_for
    from shardwise.runtime.process.groups import stream_pairs

    transport = transport_for([s.mesh for s in pipe.stages])
    ends = [*transport._sends.values(), *transport._recvs.values()]  # type: ignore[attr-defined]
    links = [link for link, _, _ in ends if link.peer is not None]
    assert links, "a pipeline over processes has links"
    if not WORLD.force_stream_groups:
        assert not WORLD.streams and all(link._streams is None for link in links)
        return
    assert all(link._streams is WORLD.streams for link in links)
    pairs = stream_pairs([s.mesh for s in pipe.stages])
    assert pairs, "a pipeline over processes has streams"
    me = dist.get_rank()
    mine = [WORLD.streams[k] for k in pairs if me in k[:2]]  # others: NON_GROUP_MEMBER
    assert len({id(g) for g in mine}) == len(mine), "two streams share a group"
    for g in mine:
        assert dist.get_world_size(g) == 2 and g is not dist.group.WORLD


def body_stream_groups_pp4(n: int) -> None:
    """NCCL's stream layout on Gloo (SHARDWISE_P2P_STREAM_GROUPS=1), pp=4: 1F1B,
    interleaved and ZBV (two stages of one rank side by side) equal torch's."""
    assert WORLD.force_stream_groups, "launch with SHARDWISE_P2P_STREAM_GROUPS=1"
    _schedules_pp4(n, ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"], (2 * n,))


def body_stream_groups_pp2_tp2(n: int) -> None:
    """NCCL's stream layout on Gloo, pp=2 x tp=2 (tp-sharded activations, Partial
    gradients): 1F1B and interleaved 1F1B equal torch's (and the clipped norm)."""
    assert WORLD.force_stream_groups, "launch with SHARDWISE_P2P_STREAM_GROUPS=1"
    _schedules_pp2_tp2(n, ["1F1B", "Interleaved1F1B"], (1, 4))


class _DiesAt(torch.nn.Module):
    """A stage that kills its process at the forward of microbatch ``at`` when ``armed``."""

    def __init__(self, armed: bool, at: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.armed, self.at, self.calls = armed, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and self.calls == self.at:
            os._exit(17)
        self.calls += 1
        return self.lin(x)


def body_stage_dies_mid_step(n: int) -> None:
    """pp=n, 1F1B, 2n microbatches: the last stage's process dies at its second forward;
    every other rank's step raises CollectiveError within the timeout (+ slack), naming
    a peer rank, the stages and the tag it waited for."""
    import torch.nn.functional as F

    from shardwise.pipelining import Schedule1F1B, pipeline

    me = dist.get_rank()
    torch.manual_seed(0)
    stages = [_DiesAt(s == n - 1 and me == n - 1, 1) for s in range(n)]
    pipe = pipeline(stages, DeviceMesh.cpu(n, "pp"))
    sched = Schedule1F1B(pipe, n_microbatches=2 * n, loss_fn=F.mse_loss)
    x, t = torch.randn(2 * n, 4), torch.randn(2 * n, 4)
    text, took = _timed(lambda: sched.step(x, target=t))
    assert "from stage" in text and "to stage" in text and "rank" in text, text
    _report("stage dies mid-step", text, took)
