"""The one error family of shardwise.

Every message says what failed, the offending value, the rule, and how to fix it.
"""

from __future__ import annotations

__all__ = ["ConversionError", "ShardingError", "ShardingTypeError"]


class ShardingError(ValueError):
    """Invalid sharding, mesh, placement or layout input (a ``ValueError``)."""


class ConversionError(ShardingError):
    """A conversion between sharding forms would lose information."""


class ShardingTypeError(ShardingError, TypeError):
    """A value of the wrong kind was passed (e.g. a torch.Tensor where a shardwise
    Tensor is required). Both a ``ValueError`` and a ``TypeError``."""
