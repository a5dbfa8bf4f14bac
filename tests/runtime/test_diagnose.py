"""Naming the absent ranks of a timed-out collective (runtime/process/diagnose.py),
deterministically, with a store that lives, dies midway, or is gone: the error names
the absent rank whenever one complete read succeeded, says why it cannot otherwise,
and every wait is bounded."""

from __future__ import annotations

import datetime
import time
from types import SimpleNamespace
from typing import Any

import pytest

from shardwise.runtime.process import diagnose

CH = SimpleNamespace(key="g", seq=7, ranks=(0, 1, 2))


class Store:
    """A rendezvous store in memory that stops answering after ``reads`` checks (its
    host exited), as TCPStore raises then."""

    def __init__(self, keys: set[str], reads: int = 10**9) -> None:
        self.keys, self.reads = set(keys), reads
        self.timeout = datetime.timedelta(seconds=300)
        self.timeouts: list[datetime.timedelta] = []

    def check(self, keys: list[str]) -> bool:
        if self.reads <= 0:
            raise RuntimeError("Connection reset by peer")
        self.reads -= 1
        return all(k in self.keys for k in keys)

    def set(self, key: str, value: str) -> None:
        if self.reads <= 0:
            raise RuntimeError("Connection reset by peer")
        self.keys.add(key)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeouts.append(timeout)
        self.timeout = timeout


def _note(rank: int) -> str:
    return f"shardwise/waiting/g/7/{rank}"


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(diagnose, "SLACK_S", 0.3)

    def use(store: Store | None, rank: int) -> None:
        monkeypatch.setattr(diagnose, "_store", lambda: store)
        monkeypatch.setattr(diagnose.dist, "get_rank", lambda: rank)

    return use


def _text(absent: list[int] | None, rank: int = 1) -> str:
    return diagnose.failed_text(CH, "mesh axis x", "all_reduce", RuntimeError("timed out"),
                                absent, 5.0)


def test_a_live_store_names_the_absent_rank_and_restores_its_timeout(world: Any) -> None:
    store = Store({_note(0), _note(1)})
    world(store, 1)
    start = time.monotonic()
    assert diagnose.absent(CH) == [2]
    assert time.monotonic() - start < 0.3 + 0.5  # the slack, not the store's timeout
    assert store.timeouts[0] == datetime.timedelta(seconds=0.3)  # reads bounded
    assert store.timeout == datetime.timedelta(seconds=300)  # then restored
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
    text = _text(None)
    assert "timed out after 5 s on rank 1" in text
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
