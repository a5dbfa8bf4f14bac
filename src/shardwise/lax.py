"""Collectives by mesh-axis name inside ``shard_map`` (``jax.lax``'s names).

The public face of :mod:`shardwise.spmd.lax`, where they are defined (and listed, in
its ``__all__``).
"""

from shardwise.spmd import lax as _defined
from shardwise.spmd.lax import *  # noqa: F403  (the names of _defined.__all__)

__all__ = list(_defined.__all__)
