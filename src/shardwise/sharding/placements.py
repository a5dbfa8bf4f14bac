"""Placements: how one mesh axis holds a tensor.

Invariants:
- ``Replicated()``: every device along the axis holds the same value.
- ``Sharded(axis)``: devices along the axis hold consecutive pieces of tensor
  dim ``axis`` (split rule in :mod:`shardwise.sharding.shapes`).
- ``Partial(op)``: devices along the axis hold values whose reduction by
  ``op`` is the global value. The op is part of the value: never dropped.

On a 2-device axis, a global ``[a0, a1, a2]``::

    placement          device 0        device 1
    Replicated()       [a0, a1, a2]    [a0, a1, a2]
    Sharded(axis=0)    [a0, a1]        [a2]
    Partial('sum')     p0              p1            with p0 + p1 == [a0, a1, a2]
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shardwise.sharding.errors import ShardingError

__all__ = ["Partial", "Placement", "ReduceOp", "Replicated", "Sharded"]


class ReduceOp(Enum):
    """Reduction of a Partial placement or a reducing collective."""

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PROD = "prod"

    @classmethod
    def parse(cls, value: ReduceOp | str) -> ReduceOp:
        """``ReduceOp.SUM`` from ``ReduceOp.SUM``, ``"sum"`` or ``"SUM"``."""
        if isinstance(value, ReduceOp):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        names = ", ".join(repr(op.value) for op in cls)
        raise ShardingError(
            f"Unknown reduce op {value!r}: it must be a ReduceOp or one of {names}. "
            "Use e.g. ReduceOp.SUM or 'sum'."
        )

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


@dataclass(frozen=True, slots=True)
class Placement:
    """Abstract base of the three placements (a closed union: match on it)."""

    def __post_init__(self) -> None:
        if type(self) is Placement:
            raise ShardingError(
                "Placement is abstract: use Replicated(), Sharded(axis) or Partial(op)."
            )

    @property
    def short(self) -> str:
        """Short form used in visualisations: ``R``, ``S(0)``, ``P(sum)``."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Replicated(Placement):
    """Every device on this mesh axis holds the same copy of the data.

    Two devices, global ``x``: device 0 holds ``x``, device 1 holds ``x``.
    """

    @property
    def short(self) -> str:
        return "R"

    def __repr__(self) -> str:
        return "Replicated()"


@dataclass(frozen=True, slots=True)
class Sharded(Placement):
    """Every device on this mesh axis holds a slice of tensor dim ``axis``.

    Two devices, global ``x`` of shape ``(5, 2)``, ``Sharded(0)``:
    device 0 holds ``x[0:3]``, device 1 holds ``x[3:5]``.
    A negative ``axis`` counts from the end and is normalised once the
    tensor's rank is known.
    """

    axis: int

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise ShardingError(
                f"Sharded(axis={self.axis!r}): axis must be an int tensor dimension. "
                f"Got {type(self.axis).__name__}; use e.g. Sharded(0)."
            )

    @property
    def short(self) -> str:
        return f"S({self.axis})"

    def __repr__(self) -> str:
        return f"Sharded(axis={self.axis})"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Every device on this mesh axis holds a partial value; reducing them by
    ``reduce_op`` gives the global value.

    Two devices, ``Partial('sum')``: device 0 holds ``p0``, device 1 holds
    ``p1``; the global value is ``p0 + p1``.
    """

    reduce_op: ReduceOp = ReduceOp.SUM

    def __post_init__(self) -> None:
        object.__setattr__(self, "reduce_op", ReduceOp.parse(self.reduce_op))

    @property
    def short(self) -> str:
        return f"P({self.reduce_op.value})"

    def __repr__(self) -> str:
        return f"Partial(reduce_op={self.reduce_op.value!r})"
