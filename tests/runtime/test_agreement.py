"""The control message's arithmetic, without processes: the summed tails equal
``n * tail`` exactly when every member sent the same fingerprint and sequence number."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from shardwise.runtime.process import agreement
from shardwise.sharding.placements import ReduceOp

codes = st.integers(min_value=0, max_value=2**32 - 1)
seqs = st.integers(min_value=1, max_value=2**32 - 1)


def _verdicts(members: list[tuple[int, int]], op: ReduceOp = ReduceOp.SUM) -> list[bool]:
    """Each member's check: the reduced tail of all members' tails against its own
    expected one."""
    pairs = [agreement.tails(c, s, len(members), op) for c, s in members]
    pick = {ReduceOp.SUM: sum, ReduceOp.MAX: max, ReduceOp.MIN: min}[op]
    reduced = tuple(pick(col) for col in zip(*(mine for mine, _ in pairs)))
    return [reduced == want for _, want in pairs]


@given(st.lists(st.tuples(codes, seqs), min_size=2, max_size=9))
def test_sum_of_tails_detects_any_disagreement(members: list[tuple[int, int]]) -> None:
    agree = len(set(members)) == 1
    # every member reaches the same verdict from the same sum
    assert _verdicts(members) == [agree] * len(members)


@given(codes, seqs, st.integers(min_value=2, max_value=64))
def test_one_member_off_by_one_is_caught(code: int, seq: int, n: int) -> None:
    assert not any(_verdicts([(code, seq)] * (n - 1) + [(code, seq + 1)]))


def test_tail_is_exact_in_float64() -> None:
    # the largest sum of squares stays far below 2**53 for any realistic group
    assert max(agreement.tails(2**32 - 1, 2**32 - 1, 1)[0]) == 256.0**2


def test_fingerprint_fields_and_code() -> None:
    a = agreement.fingerprint("all_reduce", ReduceOp.SUM, "g", (8, 8), torch.float32)
    b = agreement.fingerprint("all_reduce", ReduceOp.MAX, "g", (8, 8), torch.float32)
    assert dict(zip(agreement.FIELDS, a.values))["reduce op"] == "sum"
    assert a.code != b.code
    # cached
    assert agreement.fingerprint("all_reduce", ReduceOp.SUM, "g", (8, 8), torch.float32) is a


def test_foldable() -> None:
    assert agreement.foldable(torch.ones(8, 8), ReduceOp.SUM)
    assert agreement.foldable(torch.ones(8, 8, dtype=torch.bfloat16), ReduceOp.AVG)
    assert not agreement.foldable(torch.ones(8, 8), ReduceOp.MAX)        # the message is summed
    assert not agreement.foldable(torch.ones(64, 64), ReduceOp.SUM)      # larger than DATA
    assert agreement.foldable(torch.ones(64, 64), ReduceOp.SUM, room=4096)  # a learned room
    assert not agreement.foldable(torch.ones(8, dtype=torch.int64), ReduceOp.SUM)  # not exact


def _fp(name: str, fold: int) -> agreement.Fingerprint:
    return agreement.fingerprint("all_reduce", ReduceOp.SUM, name, (fold,), torch.float32,
                                 fold=fold)


def test_room_is_learned_from_the_agreed_history_alone() -> None:
    """A repeated step: after one pass every collective that fits CAP finds room; the
    room before a call depends on the calls before it, never on the call itself."""
    ch = agreement.Channel(None, (0, 1), torch.device("cpu"))
    step = [_fp("a", 2048), _fp("b", 10), _fp("c", agreement.CAP + 1), _fp("a", 2048),
            _fp("d", 300)]
    rooms = []
    for _ in range(3):
        for fp in step:
            rooms.append(ch.room(torch.float32))
            ch.agreed(fp)
    assert rooms[:5] == [agreement.DATA] * 5  # nothing learned yet
    # learned: room for 2048 and 10 (powers of two); the all_reduce above CAP is the
    # next message itself (fused: no room for other data)
    assert rooms[10:] == [2048, 16, 0, 2048, 512]
    # the step's first calls follow the step's end
    assert rooms[5:7] == [agreement.DATA, agreement.DATA]


def test_room_covers_the_last_two_followers() -> None:
    """The same two collectives followed by different ones: the room fits the larger
    of the last two followers (a wrong guess costs bytes, never a fold that does not fit)."""
    ch = agreement.Channel(None, (0, 1), torch.device("cpu"))
    seen = []
    for nxt in (_fp("x", 3000), _fp("y", 700), _fp("z", 5000), _fp("y", 700), _fp("y", 700)):
        ch.last = (1, 2)
        seen.append(ch.room(torch.float32))
        ch.agreed(nxt)
    assert seen == [agreement.DATA, 4096, 4096, 8192, 8192]
    ch.last = (1, 2)
    assert ch.room(torch.float32) == 1024  # the 5000 aged out
    assert ch.room(torch.float64) == 0  # a float32 message (all that fold are float32)


def test_a_large_all_reduce_is_fused_once_it_repeated_twice() -> None:
    f32 = torch.float32
    ch = agreement.Channel(None, (0, 1), torch.device("cpu"))
    big = _fp("big", agreement.CAP * 4)
    assert big.fuse == agreement.Kind(agreement.CAP * 4, torch.float32, ReduceOp.SUM, fused=True)
    kinds = []
    for _ in range(4):
        ch.last = (5, 6)
        kinds.append(ch.kind())
        ch.agreed(big)
    # seen once: header
    assert kinds == [agreement.Kind(agreement.DATA), agreement.Kind(0, f32), big.fuse, big.fuse]
    ch.last = (5, 6)
    ch.agreed(_fp("small", 8))  # the pattern changed: a control message again
    ch.last = (5, 6)
    assert ch.kind() == agreement.Kind(8, f32)
    ch.agreed(_fp("header only", 0))
    ch.last = (5, 6)
    assert ch.kind() == agreement.Kind(8, f32)  # the larger of the last two
    ch.agreed(_fp("header only", 0))
    ch.last = (5, 6)
    assert ch.kind() == agreement.Kind(0, f32)  # neither folds: a bare header
    # a mean is not fused (the tail checks a sum, max or min), nor integers
    shape = (agreement.CAP * 4,)
    assert agreement.fingerprint("all_reduce", ReduceOp.AVG, "g", shape, torch.float32).fuse is None
    assert agreement.fingerprint("all_reduce", ReduceOp.SUM, "g", shape, torch.int64).fuse is None


@given(st.lists(st.tuples(codes, seqs), min_size=2, max_size=9),
       st.sampled_from([ReduceOp.MAX, ReduceOp.MIN]))
def test_max_and_min_tails_detect_any_disagreement(members: list[tuple[int, int]],
                                                   op: ReduceOp) -> None:
    """A fused max/min message reduces its tail by the same op: [p, -p] gives max and
    -min (or min and -max), equal to one member's [p, -p] only when all are equal."""
    agree = len(set(members)) == 1
    assert _verdicts(members, op) == [agree] * len(members)


def test_float64_data_asks_for_a_float64_message() -> None:
    ch = agreement.Channel(None, (0, 1), torch.device("cpu"))
    f64 = agreement.fingerprint("all_reduce", ReduceOp.SUM, "g", (100,), torch.float64, fold=100)
    for fp in (_fp("a", 300), f64):
        ch.last = (1, 2)
        ch.agreed(fp)
    ch.last = (1, 2)
    assert ch.kind() == agreement.Kind(512)
    assert ch.room(torch.float64) == ch.room(torch.float32) == 512
