"""The one error family of shardwise.

Every message says what failed, the offending value, the rule, and how to fix it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = [
    "CollectiveError", "ConversionError", "ShardingError", "ShardingTypeError", "check_items",
]


class ShardingError(ValueError):
    """Invalid sharding, mesh, placement or layout input (a ``ValueError``)."""


class ConversionError(ShardingError):
    """A conversion between sharding forms would lose information."""


class ShardingTypeError(ShardingError, TypeError):
    """A value of the wrong kind was passed (e.g. a torch.Tensor where a shardwise
    Tensor is required). Both a ``ValueError`` and a ``TypeError``."""


class CollectiveError(ShardingError, RuntimeError):
    """A collective failed: a peer died, timed out, or called a different collective."""


def check_items(value: Any, arg: str, expected: str) -> tuple[Any, ...]:
    """``value`` as a tuple, or a :class:`ShardingTypeError` naming ``arg`` and what
    it takes (a str is not taken as a sequence of characters).

    >>> check_items([1, 2], "sizes", "a list of ints")
    (1, 2)
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ShardingTypeError(f"{arg} must be {expected}. Got {value!r} "
                                f"({type(value).__name__}).")
    return tuple(value)
