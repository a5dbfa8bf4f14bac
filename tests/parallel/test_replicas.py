"""The replica check on the simulated runtime: which values it compares, how it names
the device whose copy differs, and that it installs nothing unless asked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_post_hooks

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.distributed import CollectiveError
from shardwise.parallel import parallelize_module, replicas
from shardwise.parallel.replicas import check_replicas
from shardwise.sharding.errors import ShardingTypeError
from shardwise.tensors.tensor import Tensor
from tests.helpers.position_faults import Net, plan


@pytest.fixture(autouse=True)
def _off() -> Iterator[None]:
    yield
    replicas.disable()


def _diverged(t: Tensor, k: int) -> Tensor:
    """``t`` with device ``k``'s block changed (what a rank-local write does)."""
    blocks = [s.clone() for s in t.shards]
    blocks[k] = blocks[k] + 1
    return Tensor(blocks, t.dist_layout, tuple(t.shape), t.dtype)


def test_equal_replicas_pass_and_a_parallelized_model_passes() -> None:
    model = Net(8)
    parallelize_module(model, DeviceMesh.cpu(2, "tp"), plan(False))
    check_replicas(model)
    check_replicas([p for p in model.parameters()])


def test_the_device_whose_copy_differs_is_named_by_majority() -> None:
    mesh = DeviceMesh.cpu((2, 3), ("dp", "tp"))
    w = sw.tensor(torch.randn(4, 6), sharding=PlacementMapping(mesh, [Replicated(), Sharded(1)]))
    check_replicas({"w": w})
    with pytest.raises(CollectiveError) as err:
        check_replicas({"w": _diverged(w, 4)}, step=9)  # (dp 1, tp 1): its dp pair is 1
    text = str(err.value)
    assert text.startswith("Replica check at step 9: w (Replicated over mesh axes ['dp'] of "), text
    assert "devices 1 and 4 hold different copies, with no majority" in text, text
    b = sw.tensor(torch.randn(6), sharding=PlacementMapping(DeviceMesh.cpu(3, "tp"),
                                                            [Replicated()]))
    with pytest.raises(CollectiveError, match=r"device 2's copy differs from the majority "
                                              r"\(devices 0 and 1\)"):
        check_replicas([b, _diverged(b, 2)])


def test_values_with_nothing_replicated_are_skipped() -> None:
    mesh = DeviceMesh.cpu(2, "tp")
    s = sw.tensor(torch.randn(4), sharding=PlacementMapping(mesh, [Sharded(0)]))
    check_replicas(_diverged(s, 1))  # shards may differ: nothing to compare


def test_bad_values_are_refused() -> None:
    with pytest.raises(ShardingTypeError, match="not a shardwise Tensor"):
        check_replicas({"x": torch.ones(2)})
    with pytest.raises(ShardingTypeError, match="takes a module"):
        check_replicas(3)  # type: ignore[arg-type]
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ShardingTypeError, match="number of optimizer steps"):
            replicas.enable(bad)  # type: ignore[arg-type]


def test_off_installs_nothing_and_on_checks_every_nth_step() -> None:
    assert replicas.ENABLED is None and not _global_optimizer_post_hooks
    model = Net(8)
    parallelize_module(model, DeviceMesh.cpu(2, "tp"), plan(False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    replicas.enable(2)
    assert len(_global_optimizer_post_hooks) == 1
    calls: list[int] = []
    real = replicas._check
    replicas._check = lambda items, step: (calls.append(step), real(items, step))  # type: ignore[assignment,func-returns-value]
    try:
        for _ in range(5):
            opt.zero_grad()
            model(torch.ones(3, 8)).sum().backward()
            opt.step()
    finally:
        replicas._check = real  # type: ignore[assignment]
    assert calls == [2, 4]
    replicas.disable()
    assert replicas.ENABLED is None and not _global_optimizer_post_hooks


def test_plain_inputs_are_recorded_only_while_on() -> None:
    model = Net(8)
    parallelize_module(model, DeviceMesh.cpu(2, "tp"), plan(False))
    model(torch.ones(3, 8))
    replicas.enable(1)
    assert replicas.ENABLED is not None
    model(torch.ones(3, 8))
    assert list(replicas.ENABLED.inputs) == ["input 0 of layers.0.mlp.fc1"]


def test_initialize_refuses_a_bad_setting_before_the_rendezvous(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import shardwise.distributed as sd

    with pytest.raises(ShardingTypeError, match="Got -1"):
        sd.initialize("gloo", rank=0, world_size=1, master_port=1, check_replicas=-1)
    monkeypatch.setenv("SHARDWISE_CHECK_REPLICAS", "often")
    with pytest.raises(sw.ShardingError, match="SHARDWISE_CHECK_REPLICAS='often'"):
        sd.initialize("gloo", rank=0, world_size=1, master_port=1)
    assert not sd.is_initialized() and replicas.ENABLED is None


def test_the_facade_exports_the_check() -> None:
    assert sw.check_replicas is check_replicas
    assert sw.parallel.check_replicas is check_replicas
