"""Sequence orders: a tensor dim held in a permuted (head-tail) order.

A context-parallel region with load balancing holds its sequence dims in head-tail
order (:func:`sequence_order`): device ``r`` of ``cp`` holds a piece from the front
and one from the back, so causal attention costs every device the same. The order is
part of the value's :class:`~shardwise.sharding.layout.Layout` (``Layout.orders``),
so blocks stay contiguous ranges of the *held* (permuted) coordinates, and everything
that shows the global value (``to_torch``, gathers) puts it back in natural order.

Invariants:
- :class:`SequenceOrder` ``(dim, length, parts, inner)``: tensor dim ``dim`` of size
  ``S`` is ``(outer, length, inner)`` flattened, its ``length`` factor in head-tail
  order of ``parts`` chunks (``inner`` > 1 or ``outer`` > 1 where a reshape merged the
  sequence with neighbouring dims: ``(B, T) -> B*T`` keeps ``(length=T, inner=1)``).
- :meth:`SequenceOrder.positions` gives, for each held index, its natural index.
- Pure Python, no torch (this package never imports it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shardwise.sharding.errors import ShardingError

__all__ = ["SequenceOrder", "sequence_order"]


@functools.lru_cache(maxsize=256)
def sequence_order(length: int, size: int, balanced: bool) -> tuple[int, ...]:
    """The natural position at each index of the CP order of a sequence of ``length``
    over ``size`` devices. Head-tail (``balanced``): device ``r``'s block (its split
    rule share) holds a head piece from the front and a tail piece from the back, the
    tails in reverse device order, so causal work is even; else the natural order.

    >>> sequence_order(8, 2, True)      # device 0: chunks 0 and 3, device 1: 1 and 2
    (0, 1, 6, 7, 2, 3, 4, 5)
    >>> sequence_order(7, 2, True)      # uneven: blocks of 4 and 3
    (0, 1, 5, 6, 2, 3, 4)
    """
    if not balanced or size == 1:
        return tuple(range(length))
    # each device's share by the split rule (shapes.split_bounds, which imports Layout)
    base, rem = divmod(length, size)
    shares = [base + (1 if r < rem else 0) for r in range(size)]
    heads = [(share + 1) // 2 for share in shares]
    tails = [share - h for share, h in zip(shares, heads)]
    front, out = sum(heads), list[int]()
    for r in range(size):
        head = sum(heads[:r])
        tail = front + sum(tails[r + 1:])
        out += range(head, head + heads[r])
        out += range(tail, tail + tails[r])
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SequenceOrder:
    """Tensor dim ``dim`` held with its ``length`` factor in head-tail order of
    ``parts`` chunks (module doc), ``inner`` consecutive entries per position.

    >>> SequenceOrder(1, 8, 2)
    SequenceOrder(dim=1, length=8, parts=2, inner=1)
    >>> SequenceOrder(0, 4, 2, inner=2).positions(8)    # (T=4, D=2) flattened
    (0, 1, 6, 7, 2, 3, 4, 5)
    """

    dim: int
    length: int
    parts: int
    inner: int = 1

    def __post_init__(self) -> None:
        for name in ("dim", "length", "parts", "inner"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (
                    0 if name == "dim" else 1):
                raise ShardingError(
                    f"SequenceOrder.{name} must be an int >= {0 if name == 'dim' else 1}. "
                    f"Got {value!r}.")

    def at(self, dim: int, inner: int | None = None) -> SequenceOrder:
        """The same order on tensor dim ``dim`` (``inner``: a new inner size)."""
        return SequenceOrder(dim, self.length, self.parts,
                             self.inner if inner is None else inner)

    def fits(self, size: int) -> bool:
        """Whether a dim of ``size`` holds whole sequences of this order."""
        return size % (self.length * self.inner) == 0

    def positions(self, size: int) -> tuple[int, ...]:
        """For each held index of a dim of ``size``, its natural index."""
        return _positions(size, self.length, self.parts, self.inner)

    def __str__(self) -> str:
        inner = f"x{self.inner}" if self.inner > 1 else ""
        return f"{self.dim}:ht{self.length}/{self.parts}{inner}"


@functools.lru_cache(maxsize=256)
def _positions(size: int, length: int, parts: int, inner: int) -> tuple[int, ...]:
    if size % (length * inner):
        raise ShardingError(
            f"A dim of size {size} does not hold whole sequences of length {length} "
            f"(x {inner}): the order cannot apply. Reorder to natural order first.")
    order = sequence_order(length, parts, True)
    out: list[int] = []
    for o in range(size // (length * inner)):
        base = o * length * inner
        for t in order:
            out += range(base + t * inner, base + (t + 1) * inner)
    return tuple(out)
