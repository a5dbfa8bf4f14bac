"""ExpertParallel on the simulated mesh: the bodies of ``expert_bodies`` (dispatch beside
the per-expert loop, the MoE GPT on dp2ep x tp), bad input, a DCP checkpoint of the
experts resharded from ep=2 to ep=4, and examples/moe_gpt.py's command."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import shardwise as sw
from shardwise import DeviceMesh, ShardingError
from shardwise.parallel import ExpertParallel, parallelize_module
from shardwise.sharding.errors import ShardingTypeError
from tests.helpers import expert_bodies
from tests.helpers.moe import HostReads, expert_loop, experts_module, moe_gpt, routed

EP2, EP4 = DeviceMesh.cpu(2, "ep"), DeviceMesh.cpu(4, "ep")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", expert_bodies.BODIES)
def test_expert_body_simulated(name: str, n: int) -> None:
    getattr(expert_bodies, name)(n)


def test_the_host_read_counter_sees_the_dropless_read() -> None:
    """The counter the capacity bodies assert 0 with: dropless reads the counts."""
    mod = parallelize_module(experts_module(4, 8, 8), EP2, ExpertParallel())
    x, counts = routed(8, 8, 4, 1)
    with HostReads() as reads:
        mod(x, counts[0])
    assert "tolist" in reads.calls


def test_router_bias_steers_the_choice_and_moves_toward_balance() -> None:
    """torchtitan's load-balancing bias: added for the top-k choice only (the gates stay
    the scores); updated outside autograd toward the mean load, centred."""
    torch.manual_seed(0)
    router = moe_gpt.TopKRouter(8, 4, 2)
    x = torch.randn(2, 5, 8)
    gates, ids, counts = router(x, torch.tensor([0.0, 0.0, 0.0, 10.0]))
    assert bool((ids == 3).any(-1).all())
    torch.testing.assert_close(gates, torch.sigmoid(router.gate(x)).gather(-1, ids))
    assert counts.tolist() == [torch.bincount(i.flatten(), minlength=4).tolist() for i in ids]
    layer = moe_gpt.MoE(moe_gpt.Config(dim=8))
    layer.tokens_per_expert = torch.tensor([10.0, 0.0, 0.0, 2.0])
    layer.update_expert_bias()
    c = layer.load_balance_coeff
    torch.testing.assert_close(layer.expert_bias, torch.tensor([-1.5, 0.5, 0.5, 0.5]) * c)
    assert layer.tokens_per_expert.tolist() == [0.0] * 4


def test_bad_input_names_the_fix() -> None:
    with pytest.raises(ShardingError, match=r"Cannot shard the 6 experts .* across 4 devices "
                                            r"of mesh axis 'ep'.*divisible by 4"):
        parallelize_module(experts_module(6, 8, 8), EP4, ExpertParallel())
    mod = parallelize_module(experts_module(4, 8, 8), EP2, ExpertParallel())
    x = torch.randn(6, 8)
    with pytest.raises(ShardingError, match=r"shape \[5\] but .* has 4 experts: the router "
                                            r"and the experts disagree.*num_experts=4"):
        mod(x, torch.tensor([1, 1, 1, 1, 2]))
    with pytest.raises(ShardingError, match=r"is \[1, 1, 1, 1\], which does not count the 6 "
                                            r"rows.*sorted by expert"):
        mod(x, torch.tensor([1, 1, 1, 1]))
    with pytest.raises(ShardingError, match=r"group 1 is \[4, -1, 0, 0\]"):
        mod(x, torch.tensor([[1, 1, 1, 0], [4, -1, 0, 0]]))
    with pytest.raises(ShardingError, match=r"takes tokens \[N, D\] in 4 group\(s\).*Got "
                                            r"tokens of shape \[6, 8\]"):
        mod(x, torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(ShardingError, match=r"Got tokens of shape \[2, 3, 8\]"):
        mod(x.view(2, 3, 8), torch.tensor([2, 2, 1, 1]))
    with pytest.raises(ShardingTypeError, match=r"takes \(tokens \[N, D\], num_tokens_per_"):
        mod(x, [1, 2, 2, 1])
    capped = parallelize_module(experts_module(4, 8, 8), EP2,
                                ExpertParallel(capacity_factor=1.0))
    with pytest.raises(ShardingError, match=r"3 group\(s\) of tokens do not divide over the "
                                            r"2 devices.*\[G, 4\] with G a multiple of 2"):
        capped(x, torch.ones(3, 4, dtype=torch.int64)[:, :4] // 2)
    for factor in (0, -1.0, True, "1"):
        with pytest.raises(ShardingTypeError, match=r"capacity_factor=...\) is a number > 0"):
            ExpertParallel(capacity_factor=factor)  # type: ignore[arg-type]
    with pytest.raises(ShardingError, match=r"has none.*Plan the experts module itself"):
        parallelize_module(nn.Module(), EP2, ExpertParallel())
    odd = experts_module(4, 8, 8)
    odd.w2 = nn.Parameter(torch.ones(2, 8, 8))
    with pytest.raises(ShardingError, match=r"'w1' has 4 and 'w2' has shape \[2, 8, 8\]"):
        parallelize_module(odd, EP2, ExpertParallel())


def test_dcp_checkpoint_reshards_experts_from_ep2_to_ep4(tmp_path: Path) -> None:
    ref = experts_module(8, 8, 12)
    saved = parallelize_module(copy.deepcopy(ref), EP2, ExpertParallel())
    with warnings.catch_warnings():  # "no process group: saving in a single process"
        warnings.simplefilter("ignore", UserWarning)
        sw.checkpoint.save(saved.state_dict(), tmp_path / "ck")
        loaded = parallelize_module(experts_module(8, 8, 12, seed=1), EP4, ExpertParallel())
        state = loaded.state_dict()
        sw.checkpoint.load(state, tmp_path / "ck")
    for name in ("w1", "w2", "w3"):
        got = getattr(loaded, name)
        assert got.placements == (sw.Sharded(0),) and got.local_shapes[0][0] == 2
        assert torch.equal(got.to_torch(), getattr(ref, name).detach())
    x, counts = routed(16, 8, 8, 2)
    want = expert_loop(ref.w1, ref.w2, ref.w3, x, counts)
    torch.testing.assert_close(loaded(x, counts).to_torch(), want.detach())


def test_moe_gpt_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert moe_gpt.main(["--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "DeviceMesh(dp=2, tp=2), experts over dp (simulated)" in out
    assert "'all_to_all': 4" in out and "parity OK" in out  # 2 blocks: dispatch + combine
    assert moe_gpt.main(["--steps", "1", "--mesh", "4x1", "--rtol", "-1"]) == 1
