"""The planner's values: :class:`StepKind`, :class:`Step`, :class:`Plan`.

Invariants:
- A step is one collective or one local op over a product group of mesh axes;
  its ``before``/``after`` layouts are the layouts around it, so a plan's steps
  chain from its ``src`` to its ``dst``.
- ``StepKind`` is a closed set: a runtime handles every member (its handler
  table is checked against the Enum), so an unknown kind fails at import, not
  in the middle of a plan.
- Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from shardwise.sharding.layout import Layout
from shardwise.sharding.placements import ReduceOp

__all__ = ["COLLECTIVES", "Plan", "Step", "StepKind", "check_handlers"]


class StepKind(str, Enum):
    """What a :class:`Step` does. A ``str`` subclass: a kind equals (and hashes,
    formats and serialises as) its value, so ``step.kind == "all_gather"`` and
    counts keyed by kind name keep working.

    >>> StepKind.ALL_GATHER == "all_gather", f"{StepKind.ALL_GATHER}"
    (True, 'all_gather')
    >>> sorted(k.value for k in StepKind if k.is_collective)
    ['all_gather', 'all_reduce', 'all_to_all', 'permute', 'reduce_scatter']
    """

    SLICE = "slice"                    # local view of this device's block
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    PERMUTE = "permute"                # each device sends its block to one peer
    MAKE_PARTIAL = "make_partial"      # local: identity elements off the group's root

    def __str__(self) -> str:
        return self.value

    @property
    def is_collective(self) -> bool:
        return self in COLLECTIVES


COLLECTIVES: frozenset[StepKind] = frozenset({
    StepKind.ALL_GATHER, StepKind.ALL_TO_ALL, StepKind.ALL_REDUCE, StepKind.REDUCE_SCATTER,
    StepKind.PERMUTE})


def check_handlers(table: Mapping[StepKind, Any], where: str,
                   elsewhere: Iterable[StepKind] = ()) -> None:
    """Fail (at the runtime's import) unless ``table`` has a handler for every
    :class:`StepKind` not in ``elsewhere`` (the kinds ``where`` handles before the table).

    >>> check_handlers({StepKind.SLICE: print}, "my runtime", elsewhere=[StepKind.PERMUTE])
    Traceback (most recent call last):
    ...
    TypeError: my runtime has no handler for step kinds ['all_gather', 'all_reduce', \
'all_to_all', 'make_partial', 'reduce_scatter']. Add one per StepKind to its table.
    """
    missing = sorted(k.value for k in set(StepKind) - set(table) - set(elsewhere))
    if missing:
        raise TypeError(f"{where} has no handler for step kinds {missing}. Add one per "
                        "StepKind to its table.")


@dataclass(frozen=True, slots=True)
class Step:
    """One collective or local op over the mesh axes ``axes`` (a product group).

    ``dim``: the tensor dim gathered, sliced or scattered (``all_to_all``: the
    dim the axes leave); ``dim2``: the dim ``all_to_all`` moves them to. A
    ``kind`` given as a string is converted to its :class:`StepKind`.

    >>> from shardwise import DeviceMesh
    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> step = Step("all_gather", (0,), Layout(mesh, ((0,),), (None,)),
    ...             Layout(mesh, ((),), (None,)), dim=0, bytes_per_device=16)
    >>> step.kind is StepKind.ALL_GATHER, str(step)
    (True, "all_gather(axes=('x',), dim=0)  16 B/device")
    """

    kind: StepKind
    axes: tuple[int, ...]
    before: Layout
    after: Layout
    dim: int | None = None
    dim2: int | None = None
    reduce_op: ReduceOp | None = None
    bytes_per_device: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, StepKind):
            try:
                kind = StepKind(self.kind)
            except ValueError:
                raise ValueError(
                    f"Step kind must be one of {[k.value for k in StepKind]}. Got "
                    f"{self.kind!r}. Use a StepKind member.") from None
            object.__setattr__(self, "kind", kind)

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.before.mesh.axis_names[a] for a in self.axes)

    def __str__(self) -> str:
        args = [f"axes={self.axis_names}"]
        if self.kind is StepKind.ALL_TO_ALL:
            args.append(f"dim {self.dim}->{self.dim2}")
        elif self.dim is not None:
            args.append(f"dim={self.dim}")
        if self.reduce_op is not None:
            args.append(f"op={self.reduce_op.value}")
        return f"{self.kind}({', '.join(args)})  {fmt_bytes(self.bytes_per_device)}/device"


@dataclass(frozen=True, slots=True)
class Plan:
    """Steps from ``src`` to ``dst`` for a tensor of ``shape`` and ``itemsize`` bytes."""

    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    itemsize: int
    steps: tuple[Step, ...] = field(default=())

    @property
    def collectives(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.is_collective)

    @property
    def bytes_per_device(self) -> int:
        return sum(s.bytes_per_device for s in self.steps)

    def __str__(self) -> str:
        head = f"Plan {self.src} -> {self.dst}  shape={list(self.shape)}"
        if not self.steps:
            return head + "\n  (no steps: layouts are equal)"
        lines = [f"  {i}. {s}" for i, s in enumerate(self.steps, 1)]
        total = f"  total {fmt_bytes(self.bytes_per_device)}/device moved"
        return "\n".join([head, *lines, total])

    def __len__(self) -> int:
        return len(self.steps)


def fmt_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB.

    >>> fmt_bytes(512), fmt_bytes(3 * 2**20)
    ('512 B', '3.0 MiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
