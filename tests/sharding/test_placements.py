"""Placements: reprs, short forms, validation, value semantics, ReduceOp.parse."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from shardwise.sharding import Partial, Placement, ReduceOp, Replicated, Sharded, ShardingError

# --- reprs and short forms ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("placement", "text", "short"),
    [
        (Replicated(), "Replicated()", "R"),
        (Sharded(0), "Sharded(axis=0)", "S(0)"),
        (Sharded(axis=2), "Sharded(axis=2)", "S(2)"),
        (Sharded(-1), "Sharded(axis=-1)", "S(-1)"),
        (Partial(), "Partial(reduce_op='sum')", "P(sum)"),
        (Partial(ReduceOp.AVG), "Partial(reduce_op='avg')", "P(avg)"),
        (Partial("min"), "Partial(reduce_op='min')", "P(min)"),
        (Partial(reduce_op="MAX"), "Partial(reduce_op='max')", "P(max)"),
        (Partial("prod"), "Partial(reduce_op='prod')", "P(prod)"),
    ],
)
def test_repr_and_short(placement: Placement, text: str, short: str) -> None:
    assert repr(placement) == text
    assert placement.short == short


def test_reduce_op_repr() -> None:
    assert repr(ReduceOp.SUM) == "ReduceOp.SUM"
    assert repr(ReduceOp.PROD) == "ReduceOp.PROD"
    assert [op.value for op in ReduceOp] == ["sum", "avg", "min", "max", "prod"]


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["0", True, False, 1.0, None, (0,)])
def test_sharded_rejects_non_int_axis(bad: object) -> None:
    with pytest.raises(ShardingError, match="axis must be an int") as info:
        Sharded(bad)
    assert f"Sharded(axis={bad!r})" in str(info.value)


@pytest.mark.parametrize("bad", ["bogus", "", "summ", 0, None, 1.5])
def test_partial_rejects_unknown_op(bad: object) -> None:
    with pytest.raises(ShardingError, match="Unknown reduce op") as info:
        Partial(bad)
    assert repr(bad) in str(info.value)
    assert "'sum'" in str(info.value)  # lists the valid ops


@pytest.mark.parametrize(
    ("text", "op"),
    [
        ("MAX", ReduceOp.MAX),
        ("Max", ReduceOp.MAX),
        ("sum", ReduceOp.SUM),
        ("AVG", ReduceOp.AVG),
        ("min", ReduceOp.MIN),
        ("Prod", ReduceOp.PROD),
    ],
)
def test_partial_parses_case_insensitively(text: str, op: ReduceOp) -> None:
    p = Partial(text)
    assert p.reduce_op is op
    assert p == Partial(op)


def test_partial_default_is_sum() -> None:
    assert Partial().reduce_op is ReduceOp.SUM


def test_placement_base_is_abstract() -> None:
    with pytest.raises(ShardingError, match="abstract"):
        Placement()


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        Sharded("x")


# --- ReduceOp.parse ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", list(ReduceOp))
def test_reduce_op_parse(op: ReduceOp) -> None:
    assert ReduceOp.parse(op) is op
    assert ReduceOp.parse(op.value) is op
    assert ReduceOp.parse(op.value.upper()) is op
    assert ReduceOp.parse(op.name) is op


@pytest.mark.parametrize("bad", ["mean", "Sum ", 3, None, ReduceOp])
def test_reduce_op_parse_rejects(bad: object) -> None:
    with pytest.raises(ShardingError, match="Unknown reduce op") as info:
        ReduceOp.parse(bad)
    assert repr(bad) in str(info.value)


# --- value semantics --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "field", "value"),
    [(Sharded(0), "axis", 1), (Partial(), "reduce_op", ReduceOp.MAX)],
)
def test_frozen(obj: Placement, field: str, value: object) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, value)
    assert getattr(obj, field) != value


def test_no_new_attributes() -> None:
    with pytest.raises((AttributeError, TypeError)):
        Replicated().extra = 1


def test_equality_and_hash() -> None:
    assert Replicated() == Replicated()
    assert Sharded(0) == Sharded(axis=0)
    assert Sharded(0) != Sharded(1)
    assert Partial() == Partial("sum") == Partial(ReduceOp.SUM)
    assert Partial("sum") != Partial("max")
    assert Replicated() != Sharded(0)
    assert Replicated() != Partial()
    assert Sharded(0) != Partial()
    values = {
        Replicated(),
        Replicated(),
        Sharded(0),
        Sharded(0),
        Sharded(1),
        Partial(),
        Partial("SUM"),
        Partial("max"),
    }
    assert values == {Replicated(), Sharded(0), Sharded(1), Partial(), Partial("max")}
    assert hash(Partial("MAX")) == hash(Partial(ReduceOp.MAX))


@pytest.mark.parametrize(
    "placement", [Replicated(), Sharded(0), Sharded(-2), Partial(), Partial("avg")]
)
def test_repr_eval_copy_pickle(placement: Placement) -> None:
    ns = {"Replicated": Replicated, "Sharded": Sharded, "Partial": Partial}
    assert eval(repr(placement), ns) == placement
    assert copy.copy(placement) == placement
    assert copy.deepcopy(placement) == placement
    assert pickle.loads(pickle.dumps(placement)) == placement


def test_match_on_closed_union() -> None:
    def describe(p: Placement) -> str:
        match p:
            case Sharded(axis=a):
                return f"sharded {a}"
            case Partial(reduce_op=op):
                return f"partial {op.value}"
            case Replicated():
                return "replicated"
        return "?"

    assert describe(Sharded(3)) == "sharded 3"
    assert describe(Partial("min")) == "partial min"
    assert describe(Replicated()) == "replicated"
