"""A GPT run (examples/gpt.py, Megatron-sharded by hand) saved on a 2x2 mesh resumes on
4x1 with exactly the losses and parameters of the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import torch

import shardwise as sw
from tests.helpers import gpt_runs
from tests.helpers.meshes import M22, M41


def test_saved_on_2x2_resumes_on_4x1_with_the_same_losses(tmp_path: Path) -> None:
    model, opt, config = gpt_runs.build(M22)
    gpt_runs.run(M22, range(1), model, opt, config)
    sw.checkpoint.save_train_state(tmp_path / "run", model, opt, step=1)
    saved = {name: {k: v.to_torch() if isinstance(v, sw.Tensor) else v.clone()
                    for k, v in opt.state[p].items()}
             for name, p in model.named_parameters()}
    uninterrupted = gpt_runs.run(M22, range(1, 3), model, opt, config)

    model2, opt2, config2 = gpt_runs.build(M41, seed=1)  # other weights until loaded
    assert sw.checkpoint.load_train_state(tmp_path / "run", model2, opt2) == 1
    for name, p in model2.named_parameters():  # AdamW's state, in the parameter's layout
        state = opt2.state[p]
        assert state["exp_avg"].dist_layout == p.dist_layout, name
        assert state["exp_avg"].mesh == M41
        for k, v in saved[name].items():
            got = state[k].to_torch() if isinstance(state[k], sw.Tensor) else state[k]
            assert torch.equal(got, v), (name, k)
    resumed = gpt_runs.run(M41, range(1, 3), model2, opt2, config2)
    assert resumed == uninterrupted  # exactly
    for (name, p), q in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(q.to_torch(), p.to_torch()), name


def test_dcp_with_torchs_state_dict_functions(tmp_path: Path) -> None:
    """The same through plain DCP and torch's get/set_state_dict, which
    shardwise.checkpoint re-exports."""
    import torch.distributed.checkpoint as dcp

    assert sw.checkpoint.get_state_dict is \
        torch.distributed.checkpoint.state_dict.get_state_dict
    model, opt, config = gpt_runs.build(M22)
    gpt_runs.run(M22, range(1), model, opt, config)
    msd, osd = sw.checkpoint.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path, no_dist=True)
    after = gpt_runs.run(M22, range(1, 2), model, opt, config)

    model2, opt2, config2 = gpt_runs.build(M41, seed=3)
    msd2, osd2 = sw.checkpoint.get_state_dict(model2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=tmp_path, no_dist=True)
    sw.checkpoint.set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    assert gpt_runs.run(M41, range(1, 2), model2, opt2, config2) == after  # exactly
