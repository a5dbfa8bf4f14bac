"""Collectives by mesh-axis name inside ``shard_map`` (``jax.lax``'s names).

The public face of :mod:`shardwise.spmd.lax`, where they are defined.
"""

from shardwise.spmd.lax import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
)

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
]
