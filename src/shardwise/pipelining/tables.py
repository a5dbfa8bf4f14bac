"""Pipeline schedules as tables: generate torch's orders, lower them, check a table runs.

``compute_table`` writes the compute actions (F, B, or I/W for zero-bubble) of each
pipeline rank in the order that rank runs them; ``lower`` adds the point-to-point
actions (SEND_F/RECV_F/SEND_B/RECV_B) and, on request, UNSHARD/RESHARD; ``validate``
checks any table (generated, lowered, or a user's CSV) before a runtime runs it.

The orders follow torch.distributed.pipelining (GPipe, 1F1B, Interleaved1F1B,
InterleavedZeroBubble = ZB1P, ZBVZeroBubble), with two differences: tables carry no
idle (``None``) padding, because the runtimes and the simulator wait on dependencies,
not on lock-step time slots; and every schedule accepts any ``n_microbatches >= 1``,
fewer than the stages included (torch refuses or hangs there).

Invariants:
- Every table ``compute_table`` returns passes ``validate`` (so it cannot deadlock),
  for every ``pp_size >= 1`` and ``n_microbatches >= 1``.
- Stage placement: loop style (rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...``)
  for GPipe, 1F1B and the interleaved schedules; V style for ZBV (rank ``r`` holds
  stages ``r`` and ``2 pp - 1 - r``). ``stage_ranks`` reads the placement back.
- A dependency that crosses ranks goes through exactly one SEND/RECV pair in a lowered
  table; one on a single rank goes through none.
- Pure: no torch; the simulator and both runtimes read the same tables.
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.pipelining.actions import Action, Kind, Table
from shardwise.sharding.errors import ShardingError

__all__ = ["SCHEDULES", "compute_table", "dependencies", "lower", "stage_ranks", "validate"]

# torch's one-letter names, as the action strings spell them
F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_WEIGHT
I = Kind.BACKWARD_INPUT  # noqa: E741
_BACKWARDS = (B, I)

#: The schedule names ``compute_table`` knows (torch's class names without "Schedule").
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


def compute_table(name: str, n_stages: int, pp_size: int, n_microbatches: int) -> Table:
    """The compute actions of schedule ``name``, per pipeline rank, in run order.

    Args:
        name: one of ``SCHEDULES`` (torch's ``Schedule<name>`` is accepted too).
        n_stages: the global number of stages: ``pp_size`` for GPipe and 1F1B, a
            multiple ``v * pp_size`` for the interleaved schedules, ``2 * pp_size``
            for ZBV.
        pp_size: the pipeline ranks.
        n_microbatches: any ``m >= 1``; fewer than the stages runs with the bubble
            it implies.

    Returns:
        rank -> its actions, as ``format_table``/``write_csv`` print them.

    1F1B on 2 ranks and 3 microbatches (rank 0 warms up with one forward):

    >>> t = compute_table("1F1B", n_stages=2, pp_size=2, n_microbatches=3)
    >>> t[0]
    [0F0, 0F1, 0B0, 0F2, 0B1, 0B2]
    >>> t[1]
    [1F0, 1B0, 1F1, 1B1, 1F2, 1B2]
    >>> compute_table("ZBVZeroBubble", 4, 2, 1)[1]
    [1F0, 2F0, 2I0, 2W0, 1I0, 1W0]
    """
    key = name.removeprefix("Schedule")
    if key not in SCHEDULES:
        raise ShardingError(
            f"Unknown pipeline schedule {name!r}: choose one of {', '.join(SCHEDULES)}.")
    for arg, value in (("n_stages", n_stages), ("pp_size", pp_size),
                       ("n_microbatches", n_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ShardingError(
                f"compute_table({key!r}): {arg} must be a positive int; got {value!r}.")
    p, m = pp_size, n_microbatches
    if key in ("GPipe", "1F1B"):
        if n_stages != p:
            raise ShardingError(
                f"Schedule {key} runs one stage per rank, so n_stages must equal "
                f"pp_size={p}; got n_stages={n_stages}. For several stages per rank use "
                "Interleaved1F1B or InterleavedZeroBubble.")
        make = _gpipe if key == "GPipe" else _one_f_one_b
        return {r: make(r, p, m) for r in range(p)}
    if key == "ZBVZeroBubble":
        if n_stages != 2 * p:
            raise ShardingError(
                f"Schedule ZBVZeroBubble runs exactly two stages per rank (V placement), "
                f"so n_stages must be 2 * pp_size = {2 * p}; got n_stages={n_stages}.")
        return {r: _zbv(r, p, m) for r in range(p)}
    if n_stages % p:
        raise ShardingError(
            f"Schedule {key} places stages round-robin on the ranks, so n_stages must be a "
            f"multiple of pp_size={p}; got n_stages={n_stages}.")
    zero_bubble = key == "InterleavedZeroBubble"
    return {r: _interleaved(r, p, n_stages // p, m, zero_bubble) for r in range(p)}


def _gpipe(r: int, p: int, m: int) -> list[Action | None]:
    """All forwards, then all backwards, in microbatch order."""
    return [*(Action(r, F, i) for i in range(m)), *(Action(r, B, i) for i in range(m))]


def _one_f_one_b(r: int, p: int, m: int) -> list[Action | None]:
    """Warm up with ``p - 1 - r`` forwards (fewer when m is smaller), then alternate
    one forward and one backward, then drain the backwards."""
    warmup = min(p - 1 - r, m)
    out: list[Action | None] = [Action(r, F, i) for i in range(warmup)]
    for i in range(warmup, m):
        out += [Action(r, F, i), Action(r, B, i - warmup)]
    out += [Action(r, B, i) for i in range(m - warmup, m)]
    return out


def _rounds(p: int, m: int) -> list[range]:
    """Microbatch groups for the interleaved schedules (depth first within a group).

    torch uses ``max(1, m // p)`` rounds of ``m / rounds`` microbatches and refuses when
    that does not divide. We keep the number of rounds and let the sizes differ by one
    (larger first): every group still has at least ``p`` microbatches when ``m >= p``,
    so a round fills the pipeline; ``m < p`` is one round of ``m``.
    """
    n = max(1, m // p)
    size, extra = divmod(m, n)
    groups, start = [], 0
    for k in range(n):
        stop = start + size + (k < extra)
        groups.append(range(start, stop))
        start = stop
    return groups


def _interleaved(r: int, p: int, v: int, m: int, zero_bubble: bool) -> list[Action | None]:
    """Interleaved 1F1B (Megatron's depth-first order) or its ZB1P zero-bubble form.

    Forwards run group by group, each group through the local stages first to last;
    backwards the same with the local stages last to first. Rank ``r`` warms up with
    ``(v - 1) * g + k * (p - 1 - r)`` forwards (``g`` the first group's size, ``k`` 2,
    or 1 for zero-bubble, whose input-gradient halves come back sooner), then
    alternates one forward and one backward, then drains. Zero-bubble defers each
    weight-gradient half: after its first ``r`` steady input halves, rank ``r`` runs
    the oldest pending W after each I, and the rest at the end.
    """
    groups = _rounds(p, m)
    fwd = [Action(c * p + r, F, i) for g in groups for c in range(v) for i in g]
    bwd_kind = I if zero_bubble else B
    bwd = [Action(c * p + r, bwd_kind, i) for g in groups for c in reversed(range(v)) for i in g]
    warmup = min((v - 1) * len(groups[0]) + (1 if zero_bubble else 2) * (p - 1 - r), m * v)
    out: list[Action | None] = list(fwd[:warmup])
    pending: list[Action] = []   # I halves whose W has not run yet, oldest first
    for step, back in enumerate(bwd):
        if warmup + step < len(fwd):
            out.append(fwd[warmup + step])
        out.append(back)
        if zero_bubble:
            pending.append(back)
            if step >= r:
                out.append(pending.pop(0)._replace(kind=W))
    out += [a._replace(kind=W) for a in pending]
    return out


def _zbv(r: int, p: int, m: int) -> list[Action | None]:
    """ZB-V (zero-bubble paper, section 6) on stages ``r`` (down the V) and
    ``2p - 1 - r`` (back up).

    The order is written for ``n = max(m, 2p - 1)`` microbatches, the fewest that fill
    the V, and the actions of microbatches ``>= m`` are then dropped: dropping a
    microbatch removes all of its actions and none that another microbatch needs, so
    the shorter table stays runnable.
    """
    n = max(m, 2 * p - 1)
    down, up = r, 2 * p - 1 - r
    out: list[Action] = []
    count = {(down, F): 0, (up, F): 0, (down, I): 0, (up, I): 0, (down, W): 0, (up, W): 0}

    def run(stage: int, kind: Kind) -> None:
        out.append(Action(stage, kind, count[stage, kind]))
        count[stage, kind] += 1

    # Warm-up: fill the way down, then interleave the way up; the last p - r forwards
    # on the way up run their backward right away (the bottom of the V turns around).
    for _ in range(2 * (p - r) - 1):
        run(down, F)
    for _ in range(r):
        run(up, F)
        run(down, F)
    for _ in range(p - r):
        run(up, F)
        run(up, I)
        run(up, W)
    # Steady state: per round, a forward down (while any remain), both halves of a
    # backward down, a forward up, both halves of a backward up.
    while count[up, F] < count[down, F] or count[down, F] < n:
        if count[down, F] < n:
            run(down, F)
        run(down, I)
        run(down, W)
        run(up, F)
        run(up, I)
        run(up, W)
    # Cool-down: the input halves first (they unblock the ranks above), the weight
    # halves fill the gaps and the end.
    for _ in range(r):
        run(down, I)
        run(up, I)
    for _ in range(p - r):
        run(down, I)
        run(down, W)
    while count[up, W] < count[up, I]:
        run(up, W)
    while count[down, W] < count[down, I]:
        run(down, W)
    return [a for a in out if a.microbatch is not None and a.microbatch < m]


def stage_ranks(table: Table) -> dict[int, int]:
    """Stage -> the pipeline rank that runs it, read from the table's actions.

    >>> stage_ranks(compute_table("ZBVZeroBubble", 4, 2, 2))
    {0: 0, 1: 1, 2: 1, 3: 0}
    """
    where: dict[int, int] = {}
    for rank in sorted(table):
        for a in table[rank]:
            if a is None:
                continue
            if where.setdefault(a.stage, rank) != rank:
                raise ShardingError(
                    f"Pipeline table: stage {a.stage} appears on rank {where[a.stage]} and on "
                    f"rank {rank} (action {a}); a stage runs on exactly one rank. Move its "
                    "actions to one rank's row.")
    return dict(sorted(where.items()))


def _input_of(a: Action) -> tuple[Action, Kind] | None:
    """The upstream action whose output compute action ``a`` consumes across stages,
    and the RECV kind that carries it; None for W and for F of stage 0 (B/I of the last
    stage is handled by the caller: it has no downstream gradient)."""
    if a.kind is F:
        return (Action(a.stage - 1, F, a.microbatch), Kind.RECV_F) if a.stage > 0 else None
    if a.kind in _BACKWARDS:
        return Action(a.stage + 1, B, a.microbatch), Kind.RECV_B
    return None


def lower(table: Table, *, fsdp: bool = False) -> Table:
    """Add the point-to-point actions (torch's lowered format); FSDP's UNSHARD/RESHARD
    around each stage's first and last action on its rank when ``fsdp``.

    A forward whose next stage is on another rank is followed by ``<s>SEND_F<mb>``; the
    receiving rank runs ``<s+1>RECV_F<mb>`` right before the forward that consumes it
    (likewise SEND_B after a B/I and RECV_B before the upstream stage's B/I). Sends are
    asynchronous and receives wait, so the lowered table runs whenever the compute table
    does. Idle slots are dropped.

    >>> t = lower(compute_table("GPipe", 2, 2, 1))
    >>> t[0], t[1]
    ([0F0, 0SEND_F0, 0RECV_B0, 0B0], [1RECV_F0, 1F0, 1B0, 1SEND_B0])
    >>> lower(compute_table("GPipe", 2, 2, 1), fsdp=True)[0]
    [0UNSHARD, 0F0, 0SEND_F0, 0RECV_B0, 0B0, 0RESHARD]
    """
    where = stage_ranks(table)
    n_stages = max(where, default=-1) + 1
    out: Table = {}
    for rank in sorted(table):
        row: list[Action | None] = []
        for a in table[rank]:
            if a is None or a.kind.is_comm:
                continue
            if a.kind in (Kind.UNSHARD, Kind.RESHARD):
                if not fsdp:
                    row.append(a)
                continue
            if a.kind is F and a.stage > 0 and where.get(a.stage - 1, rank) != rank:
                row.append(Action(a.stage, Kind.RECV_F, a.microbatch))
            if (a.kind in _BACKWARDS and a.stage < n_stages - 1
                    and where.get(a.stage + 1, rank) != rank):
                row.append(Action(a.stage, Kind.RECV_B, a.microbatch))
            row.append(a)
            if a.kind is F and a.stage < n_stages - 1 and where.get(a.stage + 1, rank) != rank:
                row.append(Action(a.stage, Kind.SEND_F, a.microbatch))
            if a.kind in _BACKWARDS and a.stage > 0 and where.get(a.stage - 1, rank) != rank:
                row.append(Action(a.stage, Kind.SEND_B, a.microbatch))
        out[rank] = _with_unshard(row) if fsdp else row
    return out


def _with_unshard(row: list[Action | None]) -> list[Action | None]:
    """UNSHARD before a stage's first action on the row, RESHARD after its last."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for k, a in enumerate(row):
        if a is not None:
            first.setdefault(a.stage, k)
            last[a.stage] = k
    out: list[Action | None] = []
    for k, a in enumerate(row):
        assert a is not None
        if first[a.stage] == k:
            out.append(Action(a.stage, Kind.UNSHARD))
        out.append(a)
        if last[a.stage] == k:
            out.append(Action(a.stage, Kind.RESHARD))
    return out


# -- validation ------------------------------------------------------------------------


def dependencies(table: Table) -> Callable[[Action], list[Action]]:
    """``deps(a)``: the actions ``a`` waits for (on any rank), for a table that
    ``validate`` accepted. F waits on the upstream F (or its RECV_F), B/I on the same
    stage's F and the downstream B/I (or its RECV_B), W on its I, SEND on the action it
    sends, RECV on the matching SEND; UNSHARD/RESHARD only on their rank's order.
    """
    present = {a for row in table.values() for a in row if a is not None}
    n_stages = max((a.stage for a in present), default=-1) + 1

    def backward_of(stage: int, mb: int | None) -> Action:
        b = Action(stage, B, mb)
        return b if b in present else Action(stage, I, mb)

    def deps(a: Action) -> list[Action]:
        s, k, mb = a
        if k is F:
            if s == 0:
                return []
            recv = Action(s, Kind.RECV_F, mb)
            return [recv if recv in present else Action(s - 1, F, mb)]
        if k in _BACKWARDS:
            out = [Action(s, F, mb)]
            if s < n_stages - 1:
                recv = Action(s, Kind.RECV_B, mb)
                out.append(recv if recv in present else backward_of(s + 1, mb))
            return out
        if k is W:
            return [Action(s, I, mb)]
        if k is Kind.SEND_F:
            return [Action(s, F, mb)]
        if k is Kind.SEND_B:
            return [backward_of(s, mb)]
        if k is Kind.RECV_F:
            return [Action(s - 1, Kind.SEND_F, mb)]
        if k is Kind.RECV_B:
            return [Action(s + 1, Kind.SEND_B, mb)]
        return []

    return deps


_RULE = {
    F: "a forward runs after the previous stage's forward of the same microbatch",
    B: "a backward runs after its own forward and the next stage's backward",
    I: "an input-gradient half runs after its own forward and the next stage's backward",
    W: "a weight-gradient half runs after its input-gradient half",
    Kind.SEND_F: "a SEND_F runs after the forward it sends",
    Kind.SEND_B: "a SEND_B runs after the backward it sends",
    Kind.RECV_F: "a RECV_F completes after the previous stage's SEND_F",
    Kind.RECV_B: "a RECV_B completes after the next stage's SEND_B",
}


def validate(table: Table, n_stages: int | None = None,
             n_microbatches: int | None = None) -> None:
    """Check that a table is runnable; raise ``ShardingError`` naming the action, the
    rank and the rule otherwise.

    Checks: stages and microbatches in range (defaults: read from the table); each
    stage on one rank; every (stage, microbatch) has exactly one F and either one B or
    one I and one W; on its rank a B/I comes after its F and a W after its I; in a
    lowered table (any SEND/RECV) each cross-rank dependency has its SEND and RECV
    and none other; and the ranks, each running its row in order and waiting on its
    dependencies, finish (no deadlock).

    >>> validate(compute_table("Interleaved1F1B", 8, 4, 3))
    >>> validate({0: [Action.parse("0F0"), Action.parse("0B0")],
    ...           1: [Action.parse("1B0"), Action.parse("1F0")]})
    Traceback (most recent call last):
    ...
    shardwise.sharding.errors.ShardingError: Pipeline table deadlocks: rank 1 runs 1B0 before ...
    """
    where = stage_ranks(table)
    actions = [(r, a) for r in sorted(table) for a in table[r] if a is not None]
    n_stages = max(where, default=-1) + 1 if n_stages is None else n_stages
    if n_microbatches is None:
        n_microbatches = max((a.microbatch for _, a in actions if a.microbatch is not None),
                             default=-1) + 1
    seen: dict[Action, int] = {}
    for r, a in actions:
        if not 0 <= a.stage < n_stages:
            raise ShardingError(
                f"Pipeline table: action {a} on rank {r} names stage {a.stage}, but the "
                f"pipeline has stages 0..{n_stages - 1}.")
        if a.microbatch is not None and not 0 <= a.microbatch < n_microbatches:
            raise ShardingError(
                f"Pipeline table: action {a} on rank {r} names microbatch {a.microbatch}, "
                f"but the step has microbatches 0..{n_microbatches - 1}.")
        if a.kind in (Kind.UNSHARD, Kind.RESHARD):
            continue
        if a in seen:
            raise ShardingError(
                f"Pipeline table: action {a} appears twice (rank {seen[a]} and rank {r}); "
                "each action runs exactly once per step.")
        seen[a] = r
    for s in range(n_stages):
        for mb in range(n_microbatches):
            _check_compute(seen, s, mb, where.get(s))
    if any(a.kind.is_comm for a in seen):
        _check_comms(seen, where, n_stages)
    order = {a: (r, k) for r in table for k, a in enumerate(table[r]) if a is not None}
    for a, r in seen.items():
        before = {F: None, B: F, I: F, W: I}.get(a.kind)
        if before is not None:
            prior = Action(a.stage, before, a.microbatch)
            if order[prior][0] == r and order[prior][1] > order[a][1]:
                raise ShardingError(
                    f"Pipeline table deadlocks: rank {r} runs {a} before {prior}; "
                    f"{_RULE[a.kind]}. Move {a} after {prior} in rank {r}'s row.")
    _check_progress(table, dependencies(table))


def _check_compute(seen: dict[Action, int], s: int, mb: int, rank: int | None) -> None:
    has = {k: Action(s, k, mb) in seen for k in (F, B, I, W)}
    where = "no rank runs it" if rank is None else f"rank {rank} runs stage {s}"
    if not has[F]:
        raise ShardingError(
            f"Pipeline table: stage {s} has no forward of microbatch {mb} ({s}F{mb}; "
            f"{where}); every (stage, microbatch) runs one F and one B (or one I and one W).")
    if has[B] and (has[I] or has[W]):
        raise ShardingError(
            f"Pipeline table: {s}B{mb} and a split backward ({s}I{mb}/{s}W{mb}) both "
            "appear; run either the full backward B or its two halves I and W.")
    if not has[B] and not (has[I] and has[W]):
        missing = f"{s}W{mb}" if has[I] else f"{s}I{mb}" if has[W] else f"{s}B{mb}"
        raise ShardingError(
            f"Pipeline table: {missing} is missing ({where}); every (stage, microbatch) "
            "runs one F and one B (or one I and one W). Add it to that rank's row.")


def _check_comms(seen: dict[Action, int], where: dict[int, int], n_stages: int) -> None:
    """A lowered table: each cross-rank edge has its SEND and its RECV, no other."""
    wanted: set[Action] = set()
    for a in seen:
        s, k, mb = a
        if k is F and s < n_stages - 1 and where[s + 1] != where[s]:
            wanted |= {Action(s, Kind.SEND_F, mb), Action(s + 1, Kind.RECV_F, mb)}
        if k in _BACKWARDS and s > 0 and where[s - 1] != where[s]:
            wanted |= {Action(s, Kind.SEND_B, mb), Action(s - 1, Kind.RECV_B, mb)}
    have = {a for a in seen if a.kind.is_comm}
    for a in sorted(wanted - have):
        raise ShardingError(
            f"Lowered pipeline table: {a} is missing (rank {where[a.stage]}); every "
            "cross-rank activation or gradient needs its SEND and its RECV. Add it, or "
            "pass the compute-only table and let lower() add them.")
    for a in sorted(have - wanted):
        raise ShardingError(
            f"Lowered pipeline table: {a} on rank {seen[a]} sends or receives nothing that "
            "crosses ranks (the stages are on one rank, or the edge does not exist). "
            "Remove it.")


def _check_progress(table: Table, deps: Callable[[Action], list[Action]]) -> None:
    """Run the ranks in dependency order; a stall is a deadlock, reported per rank."""
    rows = {r: [a for a in table[r] if a is not None] for r in table}
    done: set[Action] = set()
    pos = dict.fromkeys(rows, 0)
    progress = True
    while progress:
        progress = False
        for r, row in rows.items():
            while pos[r] < len(row) and all(d in done for d in deps(row[pos[r]])):
                done.add(row[pos[r]])
                pos[r] += 1
                progress = True
    stuck = [(r, rows[r][pos[r]]) for r in rows if pos[r] < len(rows[r])]
    if stuck:
        owner = {a: r for r, row in rows.items() for a in row}
        lines = []
        for r, a in stuck:
            waits = [d for d in deps(a) if d not in done]
            lines.append(f"rank {r} waits at {a} for " + ", ".join(
                f"{d} (rank {owner[d]}, {_blocker(rows[owner[d]], pos[owner[d]], d)})"
                for d in waits) + f" ({_RULE.get(a.kind, 'rank order')})")
        raise ShardingError(
            "Pipeline table deadlocks: " + "; ".join(lines) + ". Reorder the rows so "
            "each action comes after what it waits for.")


def _blocker(row: list[Action], pos: int, target: Action) -> str:
    """Why ``target`` has not run: it is the stuck action of its rank, or behind it."""
    if row.index(target) == pos:
        return "itself waiting"
    return f"queued behind {row[pos]}"
