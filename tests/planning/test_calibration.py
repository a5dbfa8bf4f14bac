"""``calibrate`` on 2 Gloo processes, and where its figures go: a pipeline stage's send
is priced on ``Profile.p2p`` (calibrated: the median group link), not on the slowest
collective link."""

from __future__ import annotations

import dataclasses

import torch

import shardwise as sw
from shardwise import DistributedTensorType
from shardwise.planning import ModelConfig, ParallelPlan, Transformer, estimate, get_profile
from shardwise.planning.profiles import Link
from shardwise.planning.search import inputs, train_step
from shardwise.planning.transformer import loss_fn


def test_calibrate_fits_each_group_and_prices_sends_on_their_median() -> None:
    profile = sw.calibrate(2, repeat=1, limit_s=240)
    assert set(profile.groups) == {(2, 1)}
    assert profile.p2p == profile.groups[(2, 1)]
    assert profile.flops["float32"] > 0 and profile.op_overhead > 0


def test_a_stage_send_is_priced_on_the_p2p_link() -> None:
    cfg = ModelConfig.gpt(vocab=64, seq=16, dim=32, heads=4, layers=2)
    plan = ParallelPlan(pp=2, dp=1, microbatches=2)
    sched = plan.apply(Transformer(cfg), loss_fn=loss_fn)
    opt = torch.optim.AdamW(list(sched.pipe.parameters()))
    ids = [DistributedTensorType(torch.int64, (2, cfg.seq), st.mesh,
                                 inputs(st.mesh, torch.zeros(1, 1)).placements)
           for st in (sched.pipe.stages[0], sched.pipe.stages[-1])]
    base = get_profile("h100")
    slow = Link(1e-3, 1e-6)
    times = {}
    for name, profile in (("inter", base), ("p2p", dataclasses.replace(base, p2p=slow)),
                          ("inter slow", dataclasses.replace(base, inter=slow))):
        est = estimate(train_step, sched, opt, *ids, mesh=plan.mesh(), profile=profile)
        times[name] = est.time_s
    assert times["p2p"] > times["inter"] + 1e-3          # the send's hops, on the p2p link
    assert times["p2p"] == times["inter slow"]            # as the inter link was before


def test_profile_of_prices_sends_on_the_median_group() -> None:
    from shardwise.planning.calibration import profile_of

    def one(seconds: float) -> list[float]:  # [hops, bytes, seconds] at 0 and 1 MB
        return [1, 0, 1e-3, 1, 1e6, 1e-3 + seconds]
    links = {"4,1": one(3e-3), "2,2": one(4e-3), "2,1": one(13e-3)}   # one noisy fit
    compute = {"flops": 1e11, "bandwidth": 1e10, "kernel": 2e-6, "op": 1e-4}
    profile = profile_of([{"compute": compute, "links": links}], devices=4)
    assert profile.p2p == profile.groups[(2, 2)] and profile.inter == profile.groups[(2, 1)]
