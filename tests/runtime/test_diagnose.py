"""Naming the absent ranks of a timed-out collective (runtime/process/diagnose.py),
deterministically, with a store that lives, dies midway, or is gone: the error names
the absent rank whenever one complete read succeeded, says why it cannot otherwise,
and every wait is bounded."""

from __future__ import annotations

import datetime
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from shardwise.runtime.process import diagnose

CH = SimpleNamespace(key="g", seq=7, ranks=(0, 1, 2))


class Store:
    """A rendezvous store in memory that stops answering after ``reads`` checks (its
    host exited), as TCPStore raises then."""

    host, port = "10.0.0.1", 29500

    def __init__(self, keys: set[str] | dict[str, str], reads: int = 10**9) -> None:
        self.values = dict.fromkeys(keys, "1") if isinstance(keys, set) else dict(keys)
        self.reads = reads
        self.timeout = datetime.timedelta(seconds=300)
        self.timeouts: list[datetime.timedelta] = []

    def check(self, keys: list[str]) -> bool:
        if self.reads <= 0:
            raise RuntimeError("Connection reset by peer")
        self.reads -= 1
        return all(k in self.values for k in keys)

    @property
    def keys(self) -> set[str]:
        return set(self.values)

    def set(self, key: str, value: str) -> None:
        if self.reads <= 0:
            raise RuntimeError("Connection reset by peer")
        self.values[key] = value

    def get(self, key: str) -> bytes:
        return self.values[key].encode()

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if self.values.get(key, "") == expected:
            self.values[key] = desired
        return self.values[key].encode()

    def clone(self) -> Store:
        return self

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeouts.append(timeout)
        self.timeout = timeout


def _note(rank: int) -> str:
    return f"shardwise/waiting/g/7/{rank}"


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(diagnose, "SLACK_S", 0.3)
    monkeypatch.setattr(diagnose, "BYSTANDER_S", 0.2)
    monkeypatch.setattr(diagnose.dist, "get_world_size", lambda: 3)

    def use(store: Store | None, rank: int) -> None:
        monkeypatch.setattr(diagnose, "_store", lambda: store)
        monkeypatch.setattr(diagnose.dist, "get_rank", lambda: rank)

    return use


def _text(seen: diagnose.Seen | list[int] | None, elapsed: float | None = None) -> str:
    return diagnose.failed_text(CH, "mesh axis x", "all_reduce", RuntimeError("timed out"),
                                seen, 5.0, elapsed)


def test_a_live_store_names_the_absent_rank(world: Any) -> None:
    store = Store({_note(0), _note(1)})
    world(store, 1)
    start = time.monotonic()
    assert diagnose.absent(CH) == [2]
    assert time.monotonic() - start < 0.3 + 0.5  # the slack, not the store's timeout
    assert "shardwise/read/g/7/1" in store.keys  # rank 1 says it has read
    assert "rank [2] did not arrive" in _text([2]) and "rank 1" in _text([2])


def test_a_store_lost_midway_gives_the_last_complete_read(world: Any) -> None:
    """The store's host (rank 0) exited while rank 1 still waited for rank 2's note:
    rank 2 was absent at the last read that completed, and rank 1 says so."""
    store = Store({_note(0), _note(1)}, reads=3)  # two full reads of ranks 0 and 2
    world(store, 1)
    start = time.monotonic()
    assert diagnose.absent(CH) == [2]
    assert time.monotonic() - start < 0.3 + 0.5


def test_a_store_gone_before_any_read_says_why_the_names_are_unknown(world: Any) -> None:
    world(Store({_note(0)}, reads=0), 1)
    assert diagnose.absent(CH) is None
    text = _text(None, elapsed=7.25)
    assert "timed out after 7.2 s (timeout_s=5) on rank 1" in text  # the real time
    assert "which ranks did not arrive is unknown: the rendezvous store could not be read" \
        in text and "rank 0" in text
    world(None, 1)  # no store at all (not initialized)
    assert diagnose.absent(CH) is None


def test_rank_0_stays_until_the_ranks_it_saw_have_read(world: Any) -> None:
    """Rank 0 hosts the store: it waits (bounded) for rank 1, which it saw arrive, to
    mark its read, so its exit cannot take the store from rank 1 midway."""
    store = Store({_note(0), _note(1), "shardwise/read/g/7/1"})
    world(store, 0)
    start = time.monotonic()
    assert diagnose.absent(CH) == [2]
    took = time.monotonic() - start
    assert took < 0.3 + 0.5
    store = Store({_note(0), _note(1)})  # rank 1 never reads: rank 0 waits the slack
    world(store, 0)
    start = time.monotonic()
    assert diagnose.absent(CH) == [2]
    assert 0.3 * 2 <= time.monotonic() - start < 0.3 * 2 + 0.6


class FrozenStore(Store):
    """A store whose host is stopped (SIGSTOP): reads never return, whatever the
    timeout (TCPStore's check and get then ignore it); ``answers`` reads first."""

    def __init__(self, keys: set[str], answers: int = 0) -> None:
        super().__init__(keys)
        self.answers, self.thaw = answers, threading.Event()

    def check(self, keys: list[str]) -> bool:
        if self.answers <= 0:
            self.thaw.wait()  # blocks until the test ends
        self.answers -= 1
        return super().check(keys)


def test_a_frozen_store_host_is_named_within_the_slack(world: Any) -> None:
    store = FrozenStore({_note(0)})
    world(store, 1)
    start = time.monotonic()
    seen = diagnose.examine(CH, "all_reduce")
    took = time.monotonic() - start
    store.thaw.set()
    assert took < 0.3 + 0.5, took  # the slack without an answer, not forever
    assert seen.absent is None and seen.silent_s >= 0.3
    text = _text(seen, elapsed=5.02)
    assert "timed out after 5.0 s" in text
    assert "the store's host (rank 0, 10.0.0.1:29500) did not answer within 0.3 s" in text


def test_a_store_that_freezes_midway_keeps_the_last_complete_read(world: Any) -> None:
    store = FrozenStore({_note(0)}, answers=2)  # one full read: rank 2 absent
    world(store, 1)
    start = time.monotonic()
    seen = diagnose.examine(CH, "all_reduce")
    store.thaw.set()
    assert time.monotonic() - start < 0.3 * 2 + 0.5
    assert seen.absent == [2] and seen.silent_s > 0
    assert "rank [2] did not arrive" in _text(seen)
    assert "stopped answering" in _text(seen)


def test_the_culprit_behind_a_waiting_rank_is_named(world: Any) -> None:
    """Rank 1 waits for rank 0 in group 0-1; rank 0 itself waits in group 0-2 for rank
    2, which waits nowhere (stalled): rank 2 is the culprit, rank 1 a bystander; rank
    0's failure, recorded first, is what rank 1 quotes."""
    ch = SimpleNamespace(key="0-1", seq=7, ranks=(0, 1))
    first = "rank 2 did not arrive at all_reduce #5 over ranks [0, 2] (seen by rank 0)"
    store = Store({"shardwise/waiting/0-1/7/1": "1", "shardwise/at/0": "0-2|5|all_reduce",
                   "shardwise/waiting/0-2/5/0": "1", "shardwise/first": first})
    world(store, 1)
    seen = diagnose.examine(ch, "all_gather")
    assert seen.absent == [0]
    assert seen.culprits == {2: "all_reduce #5 over ranks [0, 2]"} and seen.bystander
    text = diagnose.failed_text(ch, "mesh axis x", "all_gather", RuntimeError("timed out"),
                                seen, 5.0, 5.1)
    assert "rank 0 waits in all_reduce #5 over ranks [0, 2], where rank 2 did not arrive" \
        in text
    assert "The culprit: rank 2 did not arrive at all_reduce #5 over ranks [0, 2]; rank 1 " \
        "raised because of it" in text
    assert f"The first failure of this run: {first}." in text


def test_the_witness_records_the_first_failure(world: Any) -> None:
    store = Store({_note(0), _note(1)})
    world(store, 1)
    seen = diagnose.examine(CH, "all_reduce")
    assert seen.absent == [2] and not seen.bystander
    assert store.values["shardwise/first"] == \
        "rank 2 did not arrive at all_reduce #7 over ranks [0, 1, 2] (seen by rank 1)"
    assert "first failure" not in _text(seen)  # its own: not quoted twice
    world(store, 0)  # a later failure quotes the first
    seen = diagnose.examine(CH, "all_reduce")
    assert "The first failure of this run: rank 2 did not arrive at all_reduce #7" in _text(seen)
