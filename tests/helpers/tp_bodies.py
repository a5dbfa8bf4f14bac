"""shardwise.parallel on 4 Gloo processes (a 2x2 mesh, one device each): the GPT of
examples/gpt.py with the Megatron and sequence-parallel plans of ``gpt_plans``
trains as single-device torch does, which every rank computes itself."""

from __future__ import annotations

import torch

import shardwise as sw
from tests.helpers import gpt_plans


def _check(plan: dict[str, object], n: int) -> dict[str, object]:
    mesh = gpt_plans.mesh_of(2, n // 2)
    run = gpt_plans.train(mesh, plan)
    gpt_plans.assert_parity(run)
    # each process holds only its own block of a tp-sharded weight, in its own memory
    # (not a view keeping the global weight alive), contiguous for a column block too
    w = run["model"].get_parameter("layers.0.mlp.w1.weight")
    assert len(w.addressable_shards) == 1
    (block,) = w.addressable_shards.values()
    assert block.shape[0] == w.shape[0] // (n // 2)
    for name in ("layers.0.mlp.w1.weight", "layers.0.mlp.w2.weight"):
        (block,) = run["model"].get_parameter(name).addressable_shards.values()
        assert block.is_contiguous(), name
        assert block.untyped_storage().nbytes() == block.numel() * block.element_size(), name
    return run


def body_gpt_megatron(n: int) -> None:
    """10 AdamW steps with the Megatron plan: losses and parameters as torch's."""
    run = _check(gpt_plans.megatron_plan(), n)
    c = run["ref"].config
    assert set(run["comm"].counts) == {"all_reduce"}
    activation = 8 // 2 * c.seq * c.dim * 4
    assert len([b for _, b, _ in run["comm"].log if b >= activation]) == 1 + 2 * c.layers


def body_gpt_sequence_parallel(n: int) -> None:
    """10 AdamW steps with sequence parallelism: losses and parameters as torch's."""
    run = _check(gpt_plans.sequence_plan(), n)
    counts = run["comm"].counts
    assert counts["all_gather"] == counts["reduce_scatter"] == 2 * run["ref"].config.layers + 1


def body_gpt_megatron_fsdp(n: int) -> None:
    """TP x FSDP: the Megatron plan, then fully_shard over dp per block and on the root."""
    run = gpt_plans.train(gpt_plans.mesh_of(2, n // 2), gpt_plans.megatron_plan(), fsdp=True)
    gpt_plans.assert_parity(run)
    w = run["model"].get_parameter("layers.0.mlp.w1.weight")
    (block,) = w.addressable_shards.values()
    assert block.shape[0] == w.shape[0] // n  # rows over tp, then over dp


def body_loss_parallel(n: int) -> None:
    """cross_entropy of class-sharded logits under loss_parallel, value and gradient."""
    from shardwise import PlacementMapping, Sharded
    from shardwise.parallel import loss_parallel

    mesh = gpt_plans.mesh_of(2, n // 2)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 10, generator=g)
    target = torch.randint(0, 10, (8,), generator=g)
    x = sw.tensor(logits, sharding=PlacementMapping(mesh, [Sharded(0), Sharded(1)]))
    x.requires_grad_()
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(x, target, label_smoothing=0.1)
    loss.backward()
    ref = logits.clone().requires_grad_()
    torch.nn.functional.cross_entropy(ref, target, label_smoothing=0.1).backward()
    torch.testing.assert_close(float(loss.detach()), float(torch.nn.functional.cross_entropy(
        logits, target, label_smoothing=0.1)))
    torch.testing.assert_close(x.grad.to_torch(), ref.grad)


BODIES = [name for name in dir() if name.startswith("body_")]
