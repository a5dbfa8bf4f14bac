"""Ops on shardwise Tensors: communication ops (with their gradients) and the planner."""

from shardwise.ops.communication import (
    accelerator,
    all_gather,
    all_reduce,
    all_to_all,
    cpu,
    distributed_broadcast,
    gpu,
    plan,
    ppermute,
    reduce_scatter,
    reshard,
    shard,
    to_device,
    transfer_to,
)
from shardwise.planner import Plan, Step

__all__ = [
    "Plan",
    "Step",
    "accelerator",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "cpu",
    "distributed_broadcast",
    "gpu",
    "plan",
    "ppermute",
    "reduce_scatter",
    "reshard",
    "shard",
    "to_device",
    "transfer_to",
]
