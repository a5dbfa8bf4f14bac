"""Moved to :mod:`shardwise.runtime.process.collectives` (each torch.distributed
collective's transport and agreement check); this path stays importable."""

from shardwise.runtime.process.collectives import (
    Group,
    agree_permute,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    group,
    is_process_mesh,
    my_index,
    permute,
    process_mesh,
    rank,
    reduce_scatter,
    reset_groups,
    sizes_along,
    world_group,
)

__all__ = ["Group", "agree_permute", "all_gather", "all_reduce", "all_to_all", "broadcast",
           "group", "is_process_mesh", "my_index", "permute", "process_mesh", "rank",
           "reduce_scatter", "reset_groups", "sizes_along", "world_group"]
