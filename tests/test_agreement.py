"""The control message's arithmetic, without processes: the summed tails equal
``n * tail`` exactly when every member sent the same fingerprint and sequence number."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from shardwise.runtime.process import agreement as A
from shardwise.sharding.placements import ReduceOp

codes = st.integers(min_value=0, max_value=2**32 - 1)
seqs = st.integers(min_value=1, max_value=2**32 - 1)


def _passes(mine: tuple[float, ...], tails: list[tuple[float, ...]]) -> bool:
    summed = tuple(sum(col) for col in zip(*tails))
    return summed == tuple(v * len(tails) for v in mine)


@given(st.lists(st.tuples(codes, seqs), min_size=2, max_size=9))
def test_sum_of_tails_detects_any_disagreement(members: list[tuple[int, int]]) -> None:
    tails = [A._tail(c, s) for c, s in members]
    agree = len(set(members)) == 1
    for mine in tails:  # every member reaches the same verdict from the same sum
        assert _passes(mine, tails) == agree


@given(codes, seqs, st.integers(min_value=2, max_value=64))
def test_one_member_off_by_one_is_caught(code: int, seq: int, n: int) -> None:
    tails = [A._tail(code, seq)] * (n - 1) + [A._tail(code, seq + 1)]
    assert not any(_passes(t, tails) for t in tails)


def test_tail_is_exact_in_float64() -> None:
    # the largest sum of squares stays far below 2**53 for any realistic group
    assert max(A._tail(2**32 - 1, 2**32 - 1)) == 256.0**2


def test_fingerprint_fields_and_code() -> None:
    a = A.fingerprint("all_reduce", ReduceOp.SUM, "g", (8, 8), torch.float32)
    b = A.fingerprint("all_reduce", ReduceOp.MAX, "g", (8, 8), torch.float32)
    assert dict(zip(A.FIELDS, a.values))["reduce op"] == "sum"
    assert a.code != b.code
    assert A.fingerprint("all_reduce", ReduceOp.SUM, "g", (8, 8), torch.float32) is a  # cached


def test_foldable() -> None:
    assert A.foldable(torch.ones(8, 8), ReduceOp.SUM)
    assert A.foldable(torch.ones(8, 8, dtype=torch.bfloat16), ReduceOp.AVG)
    assert not A.foldable(torch.ones(8, 8), ReduceOp.MAX)        # the message is summed
    assert not A.foldable(torch.ones(64, 64), ReduceOp.SUM)      # larger than DATA
    assert not A.foldable(torch.ones(8, dtype=torch.int64), ReduceOp.SUM)  # not exact
