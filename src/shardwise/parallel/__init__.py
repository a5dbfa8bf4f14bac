"""Module-level parallelism on shardwise Tensors: fully sharded data parallelism
(``fully_shard``, FSDP2's semantics)."""

from shardwise.parallel.fsdp import MixedPrecisionPolicy, fully_shard, memory_per_device

__all__ = ["MixedPrecisionPolicy", "fully_shard", "memory_per_device"]
