"""Fallbacks you can see (issue 20 item 4): the warning names the op, the bytes gathered
and the user's line; CommCounter counts the gathers as their own row; strict mode makes
every fallback an error; FallbackCounter counts each run."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter, FallbackCounter
from shardwise.ops import fallbacks
from tests.helpers.meshes import M4

X = torch.arange(32.0).reshape(8, 4) / 7


def put(value: torch.Tensor, *places: Any) -> Any:
    return sw.tensor(value, sharding=PlacementMapping(M4, list(places)))


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    """Each test sees the first warning of each op, and no strict mode from outside."""
    fallbacks.forget_warnings()
    with sw.strict(False):
        yield
    fallbacks.forget_warnings()


def _warned(fn: Callable[[], Any]) -> tuple[Any, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, sw.ShardwiseFallbackWarning)]


def _line_of(fn: Callable[..., Any], needle: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if needle in text)


# Each caller reaches the fallback from a different depth inside shardwise and torch:
# a torch function, a Tensor method, a Python wrapper in torch.nn.functional, a
# handler that falls back for one case (indexing with a tensor list), and an op inside
# a user function called from the test.
def call_nonzero(x: Any) -> Any:
    return torch.nonzero(x)  # nonzero


def call_method(x: Any) -> Any:
    return x.nonzero()  # .nonzero


def call_functional(x: Any) -> Any:
    return torch.unique(x)  # unique


I0, I1 = torch.tensor([3, 0, 5]), torch.tensor([1, 2, 0])
W = torch.tensor([0.5, 1.0, 2.0, 1.5])
T = torch.tensor([0, 3, 1, 2, 2, 0, 1, 3])


def call_handler(x: Any) -> Any:
    return x[I0, I1]  # getitem


def call_loss(x: Any) -> Any:
    return torch.unique_consecutive(x, return_counts=True)  # unique_consecutive


CALLERS = [(call_nonzero, "nonzero", "torch.nonzero", torch.nonzero(X)),
           (call_method, ".nonzero", "torch.Tensor.nonzero", X.nonzero()),
           (call_functional, "unique", "unique", torch.unique(X)),
           (call_handler, "getitem", "__getitem__", X[I0, I1]),
           (call_loss, "unique_consecutive", "unique_consecutive",
            torch.unique_consecutive(X, return_counts=True))]


@pytest.mark.parametrize(("fn", "needle", "op", "want"), CALLERS,
                         ids=[c[1] for c in CALLERS])
def test_the_warning_names_the_op_the_bytes_and_the_users_line(
        fn: Callable[..., Any], needle: str, op: str, want: Any) -> None:
    x = put(X, Sharded(0))
    out, caught = _warned(lambda: fn(x))
    got = out[0].to_torch() if isinstance(out, (tuple, list)) else out.to_torch()
    ref = want[0] if isinstance(want, (tuple, list)) else want
    assert torch.equal(got, ref) and got.dtype == ref.dtype  # exact, as torch
    assert len(caught) == 1, [str(w.message) for w in caught]
    w = caught[0]
    assert (w.filename, w.lineno) == (__file__, _line_of(fn, f"# {needle}")), str(w.message)
    text = str(w.message)
    assert op in text and "no sharding rule" in text
    # each device receives the 3 other devices' 2x4 float32 blocks of x
    assert "96 B gathered per device" in text, text


def test_the_warning_is_once_per_op_until_forgotten() -> None:
    x = put(X, Sharded(0))
    assert len(_warned(lambda: [torch.nonzero(x) for _ in range(3)])[1]) == 1
    assert _warned(lambda: torch.nonzero(x, as_tuple=True))[1] == []
    assert len(_warned(lambda: x.nonzero())[1]) == 1  # another op: its own warning
    fallbacks.forget_warnings()
    assert len(_warned(lambda: torch.nonzero(x))[1]) == 1


def test_comm_counter_counts_fallback_gathers_as_their_own_row() -> None:
    x, r = put(X, Sharded(0)), put(X, Replicated())
    with warnings.catch_warnings(), CommCounter() as cc, FallbackCounter() as fc:
        warnings.simplefilter("ignore", sw.ShardwiseFallbackWarning)
        torch.nonzero(x)
        torch.nonzero(r)  # Replicated: a fallback, nothing to gather
        y = x + 1  # a rule: no communication
        float(y.sum())  # a reader gathers silently: an all_reduce, not a fallback
    assert cc.counts == {"fallback_gather": 1, "all_reduce": 1}, cc
    assert cc.bytes["fallback_gather"] == 96 == fc.events[0].nbytes
    rows = [(row.kind, row.n) for row in cc.by_line()]
    assert rows == [("fallback_gather", 1), ("all_reduce", 1)]
    assert "fallback_gather" in cc.table() and "torch.nonzero(x)" in cc.table()
    assert fc.counts == {"torch.nonzero": 2} and fc.total == 2 and fc.nbytes == 96
    assert [e.nbytes for e in fc.events] == [96, 0]


def test_fallback_counter_sees_every_run_even_with_warnings_off() -> None:
    x = put(X, Sharded(1))
    with warnings.catch_warnings(), FallbackCounter() as fc:
        warnings.simplefilter("error")  # a warning would raise: none is issued twice
        warnings.simplefilter("ignore", sw.ShardwiseFallbackWarning)
        for _ in range(3):
            torch.nonzero(x)
    assert fc.counts == {"torch.nonzero": 3}
    assert fc.events[0].where.startswith("tests/ops/test_fallbacks.py:") or \
        fc.events[0].where.startswith(__file__)
    assert repr(fc) == "FallbackCounter(torch.nonzero: 3)"
    with FallbackCounter() as none:
        x + x
    assert none.total == 0 and repr(none) == "FallbackCounter(no fallbacks)"


def test_strict_mode_turns_every_fallback_into_an_error_naming_the_op() -> None:
    x = put(X, Sharded(0))
    with sw.strict(), CommCounter() as cc, FallbackCounter() as fc:
        with pytest.raises(sw.ShardingError, match=r"torch\.nonzero has no sharding rule and "
                           r"strict mode is on .*96 B per device"):
            torch.nonzero(x)
        with pytest.raises(sw.ShardingError, match="unique"):
            torch.unique(x)
        with pytest.raises(sw.ShardingError, match="__getitem__"):
            x[I0, I1]
        # ops with rules, metadata and readers are not fallbacks
        assert torch.equal((x * 2).to_torch(), X * 2)
        assert x.is_floating_point() and float(x[0, 1]) == float(X[0, 1])
        assert torch.equal(x, x)
    assert "fallback_gather" not in cc.counts  # nothing was gathered for the refused ops
    assert fc.total == 3  # the listeners saw each one before the error
    assert not fallbacks.is_strict()  # restored on exit


def test_strict_as_a_global_switch_and_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x = put(X, Sharded(0))
    before = list(fallbacks._STRICT)
    try:
        sw.strict()  # a plain call: on for the process
        assert fallbacks.is_strict()
        with pytest.raises(sw.ShardingError, match="strict"):
            torch.nonzero(x)
        with sw.strict(False):  # allowed for one block
            assert torch.equal(torch.nonzero(x).to_torch(), torch.nonzero(X))
        assert fallbacks.is_strict()
        sw.strict(False)
        assert not fallbacks.is_strict()
        fallbacks._STRICT.clear()  # no call made: the environment decides
        monkeypatch.setenv("SHARDWISE_STRICT", "1")
        assert fallbacks.is_strict()
        with pytest.raises(sw.ShardingError, match="SHARDWISE_STRICT=1"):
            torch.nonzero(x)
        with sw.strict(False):  # a call overrides the environment
            torch.nonzero(x)
        monkeypatch.setenv("SHARDWISE_STRICT", "0")
        assert not fallbacks.is_strict()
    finally:
        fallbacks._STRICT[:] = before


def test_strict_and_fallback_counter_are_public() -> None:
    assert {"strict", "FallbackCounter"} <= set(sw.__all__)
    assert sw.strict is fallbacks.strict and sw.FallbackCounter is FallbackCounter
