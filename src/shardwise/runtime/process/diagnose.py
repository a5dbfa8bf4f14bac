"""Naming what failed, for :mod:`shardwise.runtime.process.agreement`: the ranks that did not
arrive at a collective and the fields on which members disagree, read through the
rendezvous store (never through the process group, whose state is then unknown).

Invariants:
- Only the slow or failing path comes here: nothing on the fast path touches the store.
- Every store read is bounded by a short slack (``SLACK_S``, also the store's own
  timeout meanwhile); a store that cannot be read (its host died) never blocks the
  error: the absent ranks are those of the last complete read, or unknown when no
  read succeeded, and the error then says why they are unknown.
- After naming the absent ranks a member marks that it has read; rank 0 (the store's
  host under a plain MASTER_ADDR rendezvous) waits, bounded by the slack, until the
  members it saw arrive have read too, so that its exit does not take the store from
  a slower member still naming the absent ones.
- A member leaves the mismatch exchange only when all members have read (or the slack
  ran out): the store lives in one of the processes.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["absent", "failed_text", "mismatch", "note"]

SLACK_S = 2.0   # at most this long to read the peers' notes after a failure


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no store (not initialized, or an old torch): names stay unknown
        return None


def _note_key(ch: Any, rank: int) -> str:
    return f"shardwise/waiting/{ch.key}/{ch.seq}/{rank}"


def note(ch: Any) -> None:
    """Say in the store that this rank waits at ``ch``'s current collective."""
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):  # the store's host may be the dead rank
            store.set(_note_key(ch, dist.get_rank()), "1")


def absent(ch: Any) -> list[int] | None:
    """Members with no note at this sequence number (read for up to the slack), or
    None when the store cannot be read at all; a store lost midway (its host exited)
    gives the members missing at the last complete read."""
    store = _store()
    if store is None:
        return None
    me = dist.get_rank()
    deadline = time.monotonic() + SLACK_S
    missing = [r for r in ch.ranks if r != me]
    known: list[int] | None = None
    with _short_timeout(store):
        try:
            while True:
                missing = [r for r in missing if not store.check([_note_key(ch, r)])]
                known = missing
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        except Exception:
            return known
        arrived = [r for r in ch.ranks if r != me and r not in missing]
        _linger(store, f"shardwise/read/{ch.key}/{ch.seq}/", me, arrived)
    return missing


def _linger(store: Any, prefix: str, me: int, arrived: list[int]) -> None:
    """Mark that this member has read; on rank 0 (the store's host under a plain
    rendezvous: its exit ends the store) wait, bounded, until ``arrived`` have too."""
    with contextlib.suppress(Exception):
        store.set(prefix + str(me), "1")
        if me == 0 and arrived:
            _present(store, prefix, tuple(arrived), time.monotonic() + SLACK_S)


@contextlib.contextmanager
def _short_timeout(store: Any) -> Iterator[None]:
    """The store's own timeout at most the slack meanwhile (a read from a host that
    vanished without closing its connection then fails in time)."""
    before = None
    with contextlib.suppress(Exception):
        before = store.timeout
        store.set_timeout(datetime.timedelta(seconds=SLACK_S))
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(Exception):
                store.set_timeout(before)


def failed_text(ch: Any, label: str, what: str, err: Exception, absent: list[int] | None,
                timeout_s: float) -> str:
    """A failed or timed-out control message, naming the absent ranks when known."""
    timed_out = "timed out" in str(err).lower() or "timeout" in str(err).lower()
    how = (f"timed out after {timeout_s:g} s" if timed_out
           else "failed (a peer closed its connection or errored)")
    if absent is None:
        who = ("; which ranks did not arrive is unknown: the rendezvous store could not be "
               "read (its host, rank 0 under a plain MASTER_ADDR rendezvous, may have "
               "exited or died)")
    elif absent:
        who = (f"; rank{'s' if len(absent) > 1 else ''} {absent} did not arrive (dead, "
               "stalled, or waiting in another collective)")
    else:
        who = ""
    return (f"{what} over {label} (ranks {list(ch.ranks)}, collective #{ch.seq} of this "
            f"group) {how} on rank {dist.get_rank()}{who}. Every process must run the same "
            f"collectives in the same order; look for a rank-dependent branch, a crash or a "
            f"stall on the absent rank. Underlying error: {str(err)[:300]}")


def mismatch(ch: Any, label: str, fields: dict[str, str], what: str) -> str:
    """Every member detected it: publish this member's fingerprint ``fields`` in the
    store, read the others' (bounded), and name the fields that differ and who holds
    what (the text of the error)."""
    me = dist.get_rank()
    mine = {"seq": str(ch.seq), **fields}
    store = _store()
    views: dict[int, dict[str, str]] = {me: mine}
    if store is not None:
        prefix = f"shardwise/mismatch/{ch.key}/{ch.mismatches}/"
        deadline = time.monotonic() + SLACK_S
        try:
            store.set(prefix + str(me), json.dumps(mine))
            for r in _present(store, prefix, ch.ranks, deadline):
                views[r] = json.loads(store.get(prefix + str(r)).decode())
            # The store lives in one of the processes: none leaves before all have read.
            store.set(prefix + f"read/{me}", "1")
            _present(store, prefix + "read/", ch.ranks, deadline)
        except Exception:  # the store is best effort: the error is raised regardless
            pass
    return _mismatch_text(ch, label, what, list(fields), views)


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


def _mismatch_text(ch: Any, label: str, what: str, fields: list[str],
                   views: dict[int, dict[str, str]]) -> str:
    me = dist.get_rank()
    lines = []
    for field in ("seq", *fields):
        held: dict[str, list[int]] = {}
        for r in sorted(views):
            held.setdefault(views[r][field], []).append(r)
        if len(held) > 1:
            name = "sequence number (collectives so far on this group)" if field == "seq" \
                else field
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
