"""pipeline(): splitting a model at module names, stage placement (loop and V), the
original model's names, deferred (meta) init, and the errors that name the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardwise import DeviceMesh, ShardingError
from shardwise.pipelining import pipeline
from tests.helpers import pp_models as pm

MESH = DeviceMesh.cpu((2, 2), ("pp", "tp"))


def test_split_gpt_at_module_names() -> None:
    model = pm.make(4)
    pipe = pipeline(model, MESH, split_points=["layers.2"])
    s0, s1 = (s.module for s in pipe.stages)
    assert isinstance(s1.embed, nn.Identity) and isinstance(s0.head, nn.Identity)
    assert isinstance(s0.norm, nn.Identity) and s1.norm is model.norm
    assert [b for b in s0.layers] == list(model.layers)[:2]  # shared, not copied
    assert [b for b in s1.layers] == list(model.layers)[2:]
    # stage-local names are renumbered (a ModuleList), the Pipe's are the model's
    assert "layers.0.mlp.w1.weight" in s1.state_dict()
    assert pipe.state_dict().keys() == model.state_dict().keys()
    assert dict(pipe.named_parameters()) == dict(model.named_parameters())
    assert [(s.index, s.rank, s.mesh) for s in pipe.stages] == [
        (0, 0, MESH.submesh(pp=0)), (1, 1, MESH.submesh(pp=1))]
    x, _ = pm.batch(pm.config(4), 2)
    torch.testing.assert_close(s1(s0(x)), model(x), rtol=0, atol=0)


def test_container_name_and_stage_list() -> None:
    model = pm.make(2)
    pipe = pipeline(model, MESH, split_points=["layers"])  # begins at layers.0
    assert len(pipe.stages[0].module.layers) == 0
    mods = [nn.Linear(2, 2), nn.Linear(2, 2)]
    pipe = pipeline(mods, MESH)
    assert [s.module for s in pipe.stages] == mods
    assert "Pipe(2 stages" in repr(pipe)


def test_placement_loop_and_v() -> None:
    mesh = DeviceMesh.cpu((2, 1), ("pp", "tp"))
    mods = [nn.Linear(2, 2) for _ in range(4)]
    assert [s.rank for s in pipeline(mods, mesh, stages_per_rank=2).stages] == [0, 1, 0, 1]
    v = pipeline(mods, mesh, stages_per_rank=2, style="v")
    assert [s.rank for s in v.stages] == [0, 1, 1, 0]
    assert v.stages[1].mesh == v.stages[2].mesh
    one = pipeline(mods[:2], DeviceMesh.cpu(2, "pp"))  # a pp-only mesh: one device each
    assert [s.mesh.num_devices for s in one.stages] == [1, 1]


def test_meta_model_materializes_local_stages() -> None:
    with torch.device("meta"):
        model = pm.make(2)
    pipe = pipeline(model, MESH, split_points=["layers.1"])
    assert all(p.is_meta for p in pipe.parameters())
    calls: list[int] = []
    pipe.materialize(lambda m: calls.append(1))
    assert len(calls) == 2 and not any(p.is_meta for p in pipe.parameters())
    with torch.device("meta"):
        model = pm.make(2)
    pipe = pipeline(model, MESH, split_points=["layers.1"]).materialize()
    w = pipe.stages[0].module.embed.tok.weight
    assert not w.is_meta and bool(w.abs().sum() > 0)  # reset_parameters ran


def test_errors_name_the_fix() -> None:
    model = pm.make(2)
    with pytest.raises(ShardingError, match=r"'layers.9' is not a module.*'layers.1'"):
        pipeline(model, MESH, split_points=["layers.9"])
    with pytest.raises(ShardingError, match="model order"):
        pipeline(model, MESH, split_points=["head", "layers.1"])
    with pytest.raises(ShardingError, match="3 stages cannot be placed on 2 pipeline ranks"):
        pipeline(model, MESH, split_points=["layers.0", "layers.1"])
    with pytest.raises(ShardingError, match="stages_per_rank=2"):
        pipeline([nn.Linear(2, 2)] * 2, MESH, style="v")
    with pytest.raises(ShardingError, match="no axis 'pp'"):
        pipeline(model, DeviceMesh.cpu(2, "dp"), split_points=["layers.1"])
    with pytest.raises(ShardingError, match="stages_per_rank"):
        pipeline(model, MESH, split_points=["layers.1"], stages_per_rank=0)
    root = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    root.register_parameter("scale", nn.Parameter(torch.ones(1)))
    with pytest.raises(ShardingError, match="root holds parameters"):
        pipeline(root, MESH, split_points=["1"])
