"""The time model: a compute roofline per op, an alpha-beta cost per collective and mesh
axis, and the pipeline's bubble from ``pipelining.simulate``.

Invariants:
- An op a device runs costs ``max(flops / flop rate, bytes / memory bandwidth)`` and
  its kernel overhead (the larger of the two on an accelerator, their sum on a
  host-bound CPU); each shardwise op (a torch call on shardwise Tensors) adds the
  profile's ``op_overhead``. Flops and bytes are the whole value's times the share of the op each
  device does (:class:`shardwise.debug.ledger.Context`), so nothing loops over devices.
- A collective costs its link's ``alpha * hops + beta * bytes`` (``Profile.link``).
  Collectives over the data axes may hide behind compute (``Profile.overlap``: the
  share of the compute time they can hide behind); the others are exposed.
- With pipeline stages, each stage's forward and backward per microbatch are the
  simulator's costs (plus, where sends do not overlap compute, the hop its send holds
  the rank for); the bubble is the step's time beyond the busiest stage's work. Where
  processes share fewer cores (``Profile.cores``), the simulated run is re-timed with
  processor sharing (a busy rank runs faster while others idle).
- Pure arithmetic on records: a new profile re-times an estimate without re-running it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from shardwise.planning.profiles import Profile

__all__ = ["CommRecord", "OpRecord", "Pipeline", "Timing", "time_step"]


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One op on the busiest device of a stage: flops and bytes it moves, in ``phase``
    (``"forward"``, ``"backward"``, ``"optimizer"``); ``frame``: a shardwise op's own
    overhead, not a kernel; ``kind``: a rate of its own (``Profile.flops[kind]``, where
    the profile has it: ``"attention"``, ``"transcendental"``), else the dtype's."""

    stage: int
    phase: str
    flops: float
    nbytes: float
    dtype: str
    frame: bool = False
    kind: str = ""


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective: kind, group size, bytes each device sends, the link's mesh and
    axes, the axis names, phase, stage, and whether it runs over data axes only."""

    kind: str
    group: int
    nbytes: int
    mesh: Any
    axes: tuple[int, ...]
    names: str
    phase: str
    stage: int
    data: bool


@dataclass(frozen=True)
class Pipeline:
    """A pipelined step: its compute ``table``, ``microbatches``, the bytes a stage
    sends per microbatch (``p2p_bytes``) and each stage's rank (the records' ``stage``
    is the rank: stages of one rank share its costs evenly)."""

    table: Any
    microbatches: int
    p2p_bytes: int
    rank_of: tuple[int, ...]


@dataclass(frozen=True)
class Timing:
    """Predicted step time and where it goes (seconds): ``compute`` (the busiest stage's
    ops), ``comm`` (every collective, by mesh axes), ``exposed`` (the collective time
    not hidden behind compute), ``bubble`` (pipeline idle beyond the busiest stage),
    ``step`` (their total)."""

    step: float
    compute: float
    exposed: float
    bubble: float
    comm: dict[str, float] = field(default_factory=dict)
    stages: tuple[float, ...] = ()

    def shares(self) -> dict[str, float]:
        """Compute, exposed communication and bubble as fractions of the step."""
        total = self.step or 1.0
        return {"compute": self.compute / total, "communication": self.exposed / total,
                "bubble": self.bubble / total}


def op_seconds(op: OpRecord, profile: Profile) -> float:
    """One op's time on ``profile`` (module doc).

    >>> from shardwise.planning.profiles import get_profile
    >>> h100 = get_profile("h100")
    >>> round(op_seconds(OpRecord(0, "forward", 989.4e12, 1e9, "bfloat16"), h100), 6)
    1.0
    >>> round(op_seconds(OpRecord(0, "forward", 0.0, 3.35e12, "float32"), h100), 6)
    1.0
    """
    if op.frame:
        return profile.op_overhead
    rate = profile.flops.get(op.kind) if op.kind else None
    if rate is None:
        rate = profile.flop_rate(op.dtype)
    work = max(op.flops / rate, op.nbytes / profile.memory_bandwidth)
    if profile.host_bound:
        return work + profile.kernel_overhead
    return max(work, profile.kernel_overhead)


def time_step(ops: Sequence[OpRecord], comms: Sequence[CommRecord], profile: Profile,
              pipeline: Pipeline | None = None) -> Timing:
    """The step's :class:`Timing` from its op and collective records (and its
    :class:`Pipeline`, where the step ran one)."""
    compute: dict[tuple[int, str], float] = defaultdict(float)
    for op in ops:
        compute[op.stage, op.phase] += op_seconds(op, profile)
    exposed_by: dict[tuple[int, str], float] = defaultdict(float)
    hidden_by: dict[int, float] = defaultdict(float)
    by_axes: dict[str, float] = defaultdict(float)
    for c in comms:
        t = profile.link(c.mesh, c.axes).seconds(c.kind, c.group, c.nbytes)
        by_axes[c.names] += t
        if c.data:
            hidden_by[c.stage] += t
        else:
            exposed_by[c.stage, c.phase] += t
    stages = sorted({s for s, _ in compute} | {s for s, _ in exposed_by} | set(hidden_by))
    stages = stages or [0]

    def work(s: int, phases: tuple[str, ...]) -> float:
        return sum(compute[s, p] + exposed_by[s, p] for p in phases)

    def data_exposed(s: int) -> float:
        comp = sum(compute[s, p] for p in ("forward", "backward", "optimizer"))
        return max(0.0, hidden_by[s] - profile.overlap * comp)

    per_stage = tuple(work(s, ("forward", "backward", "optimizer")) + data_exposed(s)
                      for s in stages)
    busiest = max(range(len(stages)), key=lambda i: per_stage[i])
    s0 = stages[busiest]
    comp = sum(compute[s0, p] for p in ("forward", "backward", "optimizer"))
    exposed = per_stage[busiest] - comp
    if pipeline is None or len(stages) < 2:
        return Timing(per_stage[busiest], comp, exposed, 0.0, dict(by_axes), per_stage)
    from shardwise.pipelining.simulate import simulate

    m, rank_of = pipeline.microbatches, pipeline.rank_of
    share = {r: rank_of.count(r) for r in set(rank_of)}
    fwd = [work(r, ("forward",)) / m / share[r] for r in rank_of]
    bwd = [work(r, ("backward",)) / m / share[r] for r in rank_of]
    p2p = (profile.p2p or profile.inter).seconds("permute", 2, pipeline.p2p_bytes)
    # a send that does not overlap (Gloo's blocks) holds its rank for the hop: each F
    # but the last stage's sends an activation, each B but the first stage's a gradient
    held = (1.0 - profile.overlap) * p2p
    last = len(rank_of) - 1
    fwd = [f + (held if s < last else 0.0) for s, f in enumerate(fwd)]
    bwd = [b + (held if s > 0 else 0.0) for s, b in enumerate(bwd)]
    sim = simulate(pipeline.table, forward=fwd, backward=bwd, p2p=p2p)
    tail = max(work(s, ("optimizer",)) + data_exposed(s) for s in stages)
    step = _shared(sim, len(share), profile) + tail
    bubble = max(0.0, step - per_stage[busiest])
    return Timing(step, comp, exposed, bubble, dict(by_axes), per_stage)


def _shared(sim: Any, ranks: int, profile: Profile) -> float:
    """The simulated step's time where the node's processes share fewer cores
    (``profile.cores``): the costs are those of every process busy, and while ``k``
    processes compute each runs at ``max(cores, k) / processes`` of that time (processor
    sharing: a pipeline's idle ranks leave their share to the busy ones). Why: on 4 Gloo
    ranks of 2 cores the bubble of pp4 measured about half the all-busy simulation's."""
    procs, cores = profile.devices_per_node, profile.cores
    if not cores or cores >= procs:
        return float(sim.step_time)
    spans = [s for row in sim.spans.values() for s in row]
    marks = sorted({0.0, float(sim.step_time), *(t for s in spans for t in (s.start, s.end))})
    per = procs / max(ranks, 1)
    total = 0.0
    for a, b in pairwise(marks):
        active = per * len({s.rank for s in spans if s.start <= a and s.end >= b})
        total += (b - a) * (max(cores, active) / procs if active else 1.0)
    return total
