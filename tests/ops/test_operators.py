"""Python's operators on shardwise Tensors give torch's dtype and values, always.

Every binary operator (``+ - * / // % ** & | ^ << >>`` and the comparisons), both
orders and in place, on int, bool and float Tensors laid out Sharded, Replicated and
Partial, against every kind of other operand (a Python int, float or bool, a 0-d
torch tensor, a torch tensor of each dtype): the result's dtype and values are
torch's on the global values, or both raise. ``int & bool`` once returned bools
(``&`` ran ``logical_and``): a silent wrong value.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import Partial, PlacementMapping, Replicated, Sharded
from tests.helpers.meshes import M2, M22

DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float32]
BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
    "//": operator.floordiv, "%": operator.mod, "**": operator.pow, "&": operator.and_,
    "|": operator.or_, "^": operator.xor, "<<": operator.lshift, ">>": operator.rshift,
    "==": operator.eq, "!=": operator.ne, "<": operator.lt, ">=": operator.ge,
}
INPLACE: dict[str, Callable[[Any, Any], Any]] = {
    "+=": operator.iadd, "-=": operator.isub, "*=": operator.imul, "/=": operator.itruediv,
    "//=": operator.ifloordiv, "%=": operator.imod, "**=": operator.ipow,
    "&=": operator.iand, "|=": operator.ior, "^=": operator.ixor, "<<=": operator.ilshift,
    ">>=": operator.irshift,
}


def _value(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([3, 1, 0, 2, 5, 4]).to(dtype)


def _others() -> list[tuple[str, Any]]:
    return [("int", 2), ("float", 1.5), ("bool", True), ("0-d int", torch.tensor(2)),
            ("0-d bool", torch.tensor(True)), ("0-d float", torch.tensor(1.5)),
            *((f"torch {d}", _value(d)) for d in DTYPES)]


def _layouts(value: torch.Tensor) -> list[tuple[str, sw.Tensor]]:
    """``value`` as a whole-value Tensor (``sw.tensor``) and as blocks (``sw.shard``),
    Sharded and Replicated; ints also as Partial(SUM) blocks that add up to it."""
    out = [("S(0) whole", sw.tensor(value, sharding=PlacementMapping(M2, [Sharded(0)]))),
           ("R whole", sw.tensor(value, sharding=PlacementMapping(M2, [Replicated()]))),
           ("S(0) blocks", sw.shard(value, M22, [("dp", "tp")])),
           ("R blocks", sw.shard(value, M22, [None]))]
    if not value.is_floating_point() and value.dtype != torch.bool:
        zero = torch.zeros_like(value)
        out.append(("P(sum) blocks", sw.from_local([value - 1, zero + 1],
                                                   PlacementMapping(M2, [Partial()]))))
    return out


def _outcome(op: Callable[[Any, Any], Any], a: Any, b: Any) -> tuple[str, Any]:
    try:
        return "value", op(a, b)
    except Exception as err:  # the outcome compared is "raises", whatever the type
        return "raises", type(err).__name__


def _check(got: tuple[str, Any], want: tuple[str, Any], what: str) -> None:
    if want[0] == "raises" or got[0] == "raises":
        assert got[0] == want[0], f"{what}: torch {want}, shardwise {got}"
        return
    g, w = got[1], want[1]
    assert isinstance(g, sw.Tensor), f"{what}: {type(g).__name__}, not a shardwise Tensor"
    g = g.to_torch()
    assert g.dtype == w.dtype, f"{what}: dtype {g.dtype}, torch gives {w.dtype}"
    assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)}, torch {tuple(w.shape)}"
    assert torch.equal(g.isnan(), w.isnan()) if w.is_floating_point() else True, what
    ok = (g.isnan() & w.isnan()) | (g == w) if w.is_floating_point() else g == w
    assert bool(ok.all()), f"{what}: {g.tolist()}, torch gives {w.tolist()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("symbol", list(BINARY))
def test_binary_operators_follow_torch(symbol: str, dtype: torch.dtype) -> None:
    op = BINARY[symbol]
    value = _value(dtype)
    for lname, x in _layouts(value):
        for oname, other in _others():
            what = f"{lname} {dtype} {symbol} {oname}"
            _check(_outcome(op, x, other), _outcome(op, value, other), what)
            what = f"{oname} {symbol} {lname} {dtype}"
            _check(_outcome(op, other, x), _outcome(op, other, value), what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("symbol", list(INPLACE))
def test_inplace_operators_follow_torch(symbol: str, dtype: torch.dtype) -> None:
    op = INPLACE[symbol]
    for lname, _ in _layouts(_value(dtype))[:4]:  # a Partial is not written in place
        for oname, other in _others():
            value = _value(dtype)
            x = dict(_layouts(value))[lname]
            want = _outcome(op, value, other)
            got = _outcome(op, x, other)
            what = f"{lname} {dtype} {symbol} {oname}"
            _check(got, want, what)
            if want[0] == "value":
                assert got[1] is x, f"{what}: an in-place operator returns its target"


def test_int_and_bool_is_an_int() -> None:
    """The reported case: ``int_tensor & torch.tensor(True)``."""
    x = sw.tensor(torch.tensor([1, 2, 3, 4]), sharding=PlacementMapping(M2, [Sharded(0)]))
    y = x & torch.tensor(True)
    assert y.dtype == torch.int64
    assert y.to_torch().tolist() == [1, 0, 1, 0]
    assert (x & True).to_torch().tolist() == [1, 0, 1, 0]
    assert (True & x).to_torch().tolist() == [1, 0, 1, 0]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64], ids=str)
def test_integer_partials_change_dtype_only_after_reducing(dtype: torch.dtype) -> None:
    """Partial(SUM) integer blocks add up in their own dtype (uint8 wraps: 255 + 1 == 0);
    an op that changes the dtype must reduce them first, not pass the Partial through."""
    value = torch.tensor([0, 7, 200, 3], dtype=dtype)
    shift = torch.full_like(value, 100)
    x = sw.from_local([value - shift, shift], PlacementMapping(M2, [Partial()]))
    for name, f in [("x * 1.5", lambda u: u * 1.5), ("x / 2", lambda u: u / 2),
                    ("x.sum()", lambda u: u.sum()), ("x.sum(0)", lambda u: u.sum(0)),
                    ("x + 0.5", lambda u: u + 0.5), ("x.double()", lambda u: u.double()),
                    ("x * 3", lambda u: u * 3), ("-x", lambda u: -u)]:
        got, want = f(x).to_torch(), f(value)
        assert got.dtype == want.dtype and torch.equal(got, want), (name, got, want)
