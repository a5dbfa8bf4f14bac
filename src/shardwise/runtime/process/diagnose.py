"""Naming what failed, for :mod:`shardwise.runtime.process.agreement`: the ranks that did not
arrive at a collective, the rank at the root of a chain of waits (the culprit, not a
bystander), and the fields on which members disagree, read through the rendezvous store
(never through the process group, whose state is then unknown).

Invariants:
- Only the slow or failing path comes here: nothing on the fast path touches the store.
- Every store call runs in a daemon thread on this module's own connection to the store
  (``store.clone()``), and the caller waits for it with a deadline: TCPStore's ``check``
  and ``get`` ignore their timeout while the store's host is frozen (SIGSTOP), so only
  the thread's join bounds them, and a call stuck there holds this connection's lock,
  never the process group's. The caller waits at most ``SLACK_S`` without an answer
  and ``3 * SLACK_S + BYSTANDER_S + 0.5`` s in all; a store that stops answering is named ("the
  store's host (rank 0, HOST:PORT) did not answer within N s").
- A store that cannot be read (its host died) never blocks the error: the absent ranks
  are those of the last complete read, or unknown when no read succeeded, and the error
  says why they are unknown.
- A rank that waits leaves two notes: ``waiting/<group>/<seq>/<rank>`` (it arrived
  there) and ``at/<rank>`` (where it waits, cleared when the wait ends). An absent rank
  whose ``at`` note names another collective is a bystander too: the chain of waits is
  followed (at most ``_HOPS`` hops) to the ranks that wait nowhere, the culprits.
- The first failure is recorded once (``compare_set`` on ``shardwise/first``) and every
  later error quotes it. A bystander (the absent rank it names waits elsewhere) records
  only once the culprit's witness has (or should have: its ``at`` note says when its
  wait began; at most ``SLACK_S + BYSTANDER_S`` s), and raises ``BYSTANDER_S`` later,
  so the witness fails (and exits) first and a launcher names the root cause.
- After naming the absent ranks a member marks that it has read; rank 0 (the store's
  host under a plain MASTER_ADDR rendezvous) waits, bounded by the slack, until the
  members it saw arrive and every other rank but the culprits have read too, so that
  its exit does not take the store from a slower member still naming the absent ones.
- A member leaves the mismatch exchange only when all members have read (or the slack
  ran out): the store lives in one of the processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = ["Seen", "absent", "examine", "failed_text", "first_failure", "mismatch", "note",
           "note_done", "record"]

POSITION = "issued at"  # the mismatch field of the program position (runtime.position)
SLACK_S = 2.0        # at most this long without an answer from the store after a failure
BYSTANDER_S = 1.0    # a bystander records and raises this much after the culprit's witness
_HOPS = 4            # waits followed from an absent rank to the culprit
_FIRST = "shardwise/first"
_CLONE: list[Any] = []   # [default store, this module's own connection to it]
_CLONE_LOCK = threading.Lock()


@dataclass
class Seen:
    """What the store said about one failed wait (filled by the reading thread)."""

    absent: list[int] | None = None   # members with no note (None: no complete read)
    hops: list[str] = field(default_factory=list)   # "rank 0 waits in ..." per hop
    culprits: dict[int, str] = field(default_factory=dict)  # rank -> where it did not arrive
    first: str = ""                   # the first failure recorded in the store
    silent_s: float = 0.0             # the store did not answer for this long (0: it did)
    witness_by: float = 0.0           # wall clock by which the culprit's witness fails
    host: str = ""                    # who hosts the store, and where
    answered: float = field(default_factory=time.monotonic)  # last answer (monotonic)

    @property
    def bystander(self) -> bool:
        """The ranks this one waited for wait in another collective themselves."""
        return bool(self.hops) and bool(self.culprits)


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no store (not initialized, or an old torch): names stay unknown
        return None


def _own(store: Any) -> Any:
    """This module's connection to ``store`` (made once per world, in a worker thread:
    connecting to a frozen host blocks)."""
    with _CLONE_LOCK:
        if not _CLONE or _CLONE[0] is not store:
            try:
                own = store.clone()
            except Exception:  # a store without clone(): its own connection then
                own = store
            _CLONE[:] = [store, own]
        return _CLONE[1]


def _host(store: Any) -> str:
    """Who hosts the store: rank 0 under a plain rendezvous, torchrun's agent under it."""
    under = store
    with contextlib.suppress(Exception):
        while isinstance(under, dist.PrefixStore):
            under = under.underlying_store
    where = f"{getattr(under, 'host', '?')}:{getattr(under, 'port', '?')}"
    who = ("the torchrun agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
           else "rank 0")
    return f"{who}, {where}"


def _background(fn: Callable[[Any], None]) -> None:
    """Run ``fn(own connection)`` in a daemon thread and do not wait (a note)."""
    store = _store()
    if store is None:
        return

    def work() -> None:
        with contextlib.suppress(Exception):  # the store's host may be the dead rank
            fn(_own(store))

    threading.Thread(target=work, name="shardwise-store-note", daemon=True).start()


def _bounded(fn: Callable[[Any, Seen], None], seen: Seen, limit: float) -> Seen:
    """Run ``fn(own connection, seen)`` in a daemon thread; wait while it progresses
    (``seen.answered`` moves) up to ``limit`` s, and at most ``SLACK_S`` without an
    answer. ``seen`` keeps what was read before the store stopped answering."""
    store = _store()
    if store is None:
        return seen
    seen.host = _host(store)
    failed: list[BaseException] = []

    def work() -> None:
        try:
            fn(_own(store), seen)
        except Exception as err:  # the store's host exited: keep the last complete read
            failed.append(err)

    start = seen.answered = time.monotonic()
    thread = threading.Thread(target=work, name="shardwise-store-read", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.02)
        now = time.monotonic()
        if thread.is_alive() and now - seen.answered > SLACK_S:
            seen.silent_s = now - seen.answered
            break
        if now - start > limit:  # answering, but too long: keep what was read
            break
    return seen


def _note_key(key: str, seq: int | str, rank: int) -> str:
    return f"shardwise/waiting/{key}/{seq}/{rank}"


def note(ch: Any, what: str = "collective", waited_s: float = 0.0) -> None:
    """Say in the store that this rank waits at ``ch``'s current collective (``what``,
    for ``waited_s`` so far: a bystander reads when this wait will time out), without
    waiting for the store."""
    me, key, seq = dist.get_rank(), ch.key, ch.seq
    since = time.time() - waited_s  # wall clock: the readers are other processes

    def write(store: Any) -> None:
        store.set(_note_key(key, seq, me), "1")
        store.set(f"shardwise/at/{me}", f"{key}|{seq}|{what}|{since:.3f}")

    _background(write)


def note_done() -> None:
    """This rank no longer waits (a slow wait ended): clear its ``at`` note."""
    me = dist.get_rank()
    _background(lambda store: store.set(f"shardwise/at/{me}", ""))


def examine(ch: Any, what: str = "collective") -> Seen:
    """Who did not arrive at ``ch``'s current collective (notes read for up to the
    slack), whom they wait for in turn (the culprits), and the first failure recorded
    in the store; a bystander returns ``BYSTANDER_S`` late (see the invariants)."""
    me = dist.get_rank()
    seen = _bounded(lambda store, s: _read(store, s, ch, what, me), Seen(),
                    3 * SLACK_S + BYSTANDER_S + 0.5)
    if seen.bystander and not seen.silent_s:
        time.sleep(BYSTANDER_S)  # the witness raised first; let it exit first too
    return seen


def absent(ch: Any) -> list[int] | None:
    """Members with no note at this sequence number (see :func:`examine`)."""
    return examine(ch).absent


def _read(store: Any, seen: Seen, ch: Any, what: str, me: int) -> None:
    def check(key: str) -> bool:
        found = bool(store.check([key]))
        seen.answered = time.monotonic()
        return found

    deadline = time.monotonic() + SLACK_S
    missing = [r for r in ch.ranks if r != me]
    while True:
        missing = [r for r in missing if not check(_note_key(ch.key, ch.seq, r))]
        seen.absent = list(missing)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    here = f"{what} #{ch.seq} over ranks {list(ch.ranks)}"
    _trace(store, seen, check, missing, here, me)
    mine = _summary(seen, here, me)
    if mine:
        if seen.bystander:  # the culprit's witness records first (it may time out later)
            wait_s = min(SLACK_S + BYSTANDER_S, max(seen.witness_by - time.time(), 0.0))
            wait_until = time.monotonic() + wait_s
            while not check(_FIRST) and time.monotonic() < wait_until:
                time.sleep(0.05)
        first = store.compare_set(_FIRST, "", mine)
        seen.first = first.decode() if isinstance(first, bytes) else str(first)
    else:
        seen.first = _get(store, check, _FIRST)
    arrived = [r for r in ch.ranks if r != me and r not in missing]
    _linger(store, seen, f"shardwise/read/{ch.key}/{ch.seq}/", me, arrived)


def _get(store: Any, check: Callable[[str], bool], key: str) -> str:
    """The value at ``key``, "" when there is none (``get`` would wait for it)."""
    return store.get(key).decode() if check(key) else ""


def _trace(store: Any, seen: Seen, check: Callable[[str], bool], missing: list[int],
           here: str, me: int) -> None:
    """Follow each absent rank's ``at`` note to the ranks that wait nowhere."""
    frontier = [(r, here) for r in missing]
    visited = {me}
    for _ in range(_HOPS):
        following: list[tuple[int, str]] = []
        for r, where in frontier:
            if r in visited:
                continue
            visited.add(r)
            at = _get(store, check, f"shardwise/at/{r}")
            if not at:  # dead, stalled, or computing: it waits in no collective
                seen.culprits[r] = where
                continue
            key, seq, op, since = [*at.split("|", 3), "0"][:4]
            ranks = [int(m) for m in key.split("-")]
            there = f"{op} #{seq} over ranks {ranks}"
            gone = [m for m in ranks if m != r and not check(_note_key(key, seq, m))]
            if gone:  # rank r witnesses them: it fails by then (its timeout + naming them)
                seen.witness_by = max(seen.witness_by, float(since) + _timeout_s() + SLACK_S)
            seen.hops.append(f"rank {r} waits in {there}" + (
                f", where {_ranks(gone)} did not arrive" if gone else ""))
            following += [(m, there) for m in gone]
        frontier = following
        if not frontier:
            break


def _timeout_s() -> float:
    from shardwise.runtime.process.world import WORLD

    return WORLD.timeout_s


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _summary(seen: Seen, here: str, me: int) -> str:
    """This rank's failure in one line for the store ("" when it names no one)."""
    if not seen.culprits:
        return ""
    return "; ".join(f"rank {r} did not arrive at {where}" for r, where in
                     sorted(seen.culprits.items())) + f" (seen by rank {me})"


def first_failure() -> str:
    """The first failure recorded in the store by any rank ("" when none or unreadable)."""
    def read(store: Any, seen: Seen) -> None:
        if store.check([_FIRST]):
            seen.first = store.get(_FIRST).decode()

    return _bounded(read, Seen(), SLACK_S).first


def record(text: str) -> str:
    """Record ``text`` (this rank's error, e.g. a checkpoint's) as the run's first failure
    unless one is recorded already; returns the first failure ("" when unreadable)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    mine = f"rank {dist.get_rank()}: {text[:400]}"

    def write(store: Any, seen: Seen) -> None:
        first = store.compare_set(_FIRST, "", mine)
        seen.first = first.decode() if isinstance(first, bytes) else str(first)

    return _bounded(write, Seen(), SLACK_S).first


def _linger(store: Any, seen: Seen, prefix: str, me: int, arrived: list[int]) -> None:
    """Mark that this member has read; on rank 0 when it hosts the store (a plain
    rendezvous: its exit ends the store) wait, bounded, until ``arrived`` have read too
    and every other rank but the culprits has finished reading (a bystander in another
    group still reads the notes)."""
    store.set(prefix + str(me), "1")
    store.set(f"shardwise/done/{me}", "1")
    if me != 0 or not seen.host.startswith("rank 0"):
        return
    deadline = time.monotonic() + SLACK_S
    _present(store, prefix, tuple(arrived), deadline)
    others = [r for r in range(dist.get_world_size()) if r != me and r not in seen.culprits]
    _present(store, "shardwise/done/", tuple(others), deadline)


def failed_text(ch: Any, label: str, what: str, err: Exception, seen: Seen | list[int] | None,
                timeout_s: float, elapsed: float | None = None) -> str:
    """A failed or timed-out control message, naming the absent ranks when known, the
    culprit behind them, and the first failure of the run."""
    if not isinstance(seen, Seen):
        seen = Seen(absent=seen)
    me = dist.get_rank()
    timed_out = "timed out" in str(err).lower() or "timeout" in str(err).lower()
    took = f"{elapsed:.1f} s" if elapsed is not None else f"{timeout_s:g} s"
    how = ((f"timed out after {took}" + (f" (timeout_s={timeout_s:g})" if elapsed else ""))
           if timed_out else "failed (a peer closed its connection or errored)")
    absent = seen.absent
    if seen.silent_s and absent is None:
        who = (f"; the store's host ({seen.host}) did not answer within {seen.silent_s:.1f} s: "
               "it is frozen (stopped, swapping, in a debugger) or unreachable, and is the "
               "likely culprit; which other ranks did not arrive is unknown")
    elif absent is None:
        who = ("; which ranks did not arrive is unknown: the rendezvous store could not be "
               "read (its host, rank 0 under a plain MASTER_ADDR rendezvous, may have "
               "exited or died)")
    elif absent:
        who = (f"; rank{'s' if len(absent) > 1 else ''} {absent} did not arrive (dead, "
               "stalled, or waiting in another collective)")
        if seen.bystander:
            who += ("; " + "; ".join(seen.hops) + ". The culprit: " + "; ".join(
                f"rank {r} did not arrive at {where}" for r, where in
                sorted(seen.culprits.items())) + f"; rank {me} raised because of it")
        if seen.silent_s:
            who += (f" (then the store's host ({seen.host}) stopped answering for "
                    f"{seen.silent_s:.1f} s)")
    else:
        who = ""
    own = seen.first.endswith(f"(seen by rank {me})") or seen.first.startswith(f"rank {me}: ")
    first = f" The first failure of this run: {seen.first}." if seen.first and not own else ""
    return (f"{what} over {label} (ranks {list(ch.ranks)}, collective #{ch.seq} of this "
            f"group) {how} on rank {me}{who}.{first} Every process must run the same "
            f"collectives in the same order; look for a rank-dependent branch, a crash or a "
            f"stall on the absent rank. Underlying error: {str(err)[:300]}")


def mismatch(ch: Any, label: str, fields: dict[str, str], what: str) -> str:
    """Every member detected it: publish this member's fingerprint ``fields`` in the
    store, read the others' (bounded), and name the fields that differ and who holds
    what (the text of the error)."""
    me = dist.get_rank()
    mine = {"seq": str(ch.seq), **fields}
    views: dict[int, dict[str, str]] = {me: mine}
    prefix = f"shardwise/mismatch/{ch.key}/{ch.mismatches}/"

    def exchange(store: Any, seen: Seen) -> None:
        deadline = time.monotonic() + SLACK_S
        store.set(prefix + str(me), json.dumps(mine))
        for r in _present(store, prefix, ch.ranks, deadline):
            views[r] = json.loads(store.get(prefix + str(r)).decode())
            seen.answered = time.monotonic()
        # The store lives in one of the processes: none leaves before all have read.
        store.set(prefix + f"read/{me}", "1")
        _present(store, prefix + "read/", ch.ranks, deadline)

    _bounded(exchange, Seen(), 2 * SLACK_S + 0.5)  # best effort: the error is raised anyway
    return _mismatch_text(ch, label, what, list(fields), dict(views))


def _present(store: Any, prefix: str, ranks: tuple[int, ...], deadline: float) -> list[int]:
    """The ranks whose key ``prefix + rank`` appears in the store before ``deadline``."""
    pending, found = list(ranks), []
    while pending:
        for r in list(pending):
            if store.check([prefix + str(r)]):
                found.append(r)
                pending.remove(r)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return found


def _positions(views: dict[int, dict[str, str]], me: int) -> str:
    """"rank 1 issued all_reduce at X, where ranks 0, 2 issued all_reduce at Y": this
    rank's position first, then the others', grouped."""
    def says(r: int) -> str:
        v = views[r]
        return f"{v.get('collective', '?')} at {v.get(POSITION, '?')}"

    held: dict[str, list[int]] = {}
    for r in sorted(views):
        held.setdefault(says(r), []).append(r)
    mine = says(me) if me in views else None
    order = sorted(held, key=lambda k: k != mine)
    parts = [f"rank{'s' if len(held[k]) > 1 else ''} {', '.join(map(str, held[k]))} "
             f"issued {k}" for k in order]
    return "the program position: " + parts[0] + (", where " + "; ".join(parts[1:])
                                                  if parts[1:] else "")


def _mismatch_text(ch: Any, label: str, what: str, fields: list[str],
                   views: dict[int, dict[str, str]]) -> str:
    me = dist.get_rank()
    lines: list[str] = []
    for field_ in ("seq", *fields):
        held: dict[str, list[int]] = {}
        for r in sorted(views):
            held.setdefault(views[r].get(field_, "?"), []).append(r)
        if len(held) > 1 and field_ == POSITION:
            lines.insert(0, _positions(views, me))
        elif len(held) > 1:
            name = "sequence number (collectives so far on this group)" if field_ == "seq" \
                else field_
            parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: "
                              f"{v}" for v, rs in held.items())
            lines.append(f"{name}: {parts}")
    unknown = [r for r in ch.ranks if r not in views]
    detail = (" They disagree on " + " | ".join(lines) + "." if lines else
              " Their fingerprints differ.")
    if unknown:
        detail += f" (No fingerprint from ranks {unknown}.)"
    return (f"Collective mismatch on rank {me}: {what} over {label} (ranks "
            f"{list(ch.ranks)}) was not the collective every member called.{detail} Every "
            "process must call the same collectives in the same order with the same "
            "arguments; look for a rank-dependent branch before this call. Nothing was "
            "exchanged.")
