"""Views, splits, stacks and repeats on sharding rules (ops/views.py, ops/joins.py,
issue 20): torch's values bit for bit, torch's dtype and shape, no fallback, over whole
values and blocks (uneven and empty shards); ``*_copy`` results never alias."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise import Partial, PlacementMapping, Replicated, Sharded
from shardwise.ops.registry import ShardwiseFallbackWarning
from shardwise.sharding.errors import ShardingError
from tests.helpers.meshes import M2, M4, M22
from tests.helpers.opcheck import check, pm


def _value(shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32
           ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=gen)
    v.view(-1)[:1] = -0.0  # a signed zero must survive (expand once made it +0.0)
    return (v * 10).to(dtype) if not dtype.is_floating_point else v.to(dtype)


def _layouts(v: torch.Tensor) -> list[tuple[str, sw.Tensor]]:
    out = [("R whole", sw.tensor(v, sharding=PlacementMapping(M4, [Replicated()]))),
           ("R blocks", sw.shard(v, M22, [None] * v.ndim))]
    if v.ndim:
        last = v.ndim - 1
        out += [("S(0) whole", sw.tensor(v, sharding=PlacementMapping(M4, [Sharded(0)]))),
                ("S(0) blocks", sw.shard(v, M4, ["x"] + [None] * last)),
                ("S(-1) blocks", sw.shard(v, M22, [None] * last + [("dp", "tp")]))]
    return out


def _plain(out: Any) -> Any:
    if isinstance(out, sw.Tensor):
        return out.to_torch()
    if isinstance(out, (tuple, list)):
        return [_plain(o) for o in out]
    return out


def _same(got: Any, want: Any, what: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: {type(got).__name__}"
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, torch {want.dtype}"
        assert got.shape == want.shape, f"{what}: {tuple(got.shape)}, torch {tuple(want.shape)}"
        g, w = (torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
                for t in (got, want))
        if w.is_floating_point():  # bits: signed zeros and NaNs too
            g, w = _bits(g), _bits(w)
        assert torch.equal(g, w), f"{what}: {got} vs {want}"
        return
    assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{what}: {got}"
    for i, (g, w) in enumerate(zip(got, want)):
        _same(g, w, f"{what}[{i}]")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                                8: torch.int64}[t.dtype.itemsize])


# reductions over a sharded dim add in another order (a few ulps, never more)
REORDERS = {"sum_to_size"}


def _check(fn: Callable[..., Any], *values: torch.Tensor, what: str) -> None:
    try:
        want = fn(*values)
    except (RuntimeError, NotImplementedError):  # torch refuses: so do we
        for combo in zip(*(_layouts(v) for v in values)):
            with pytest.raises(Exception):  # noqa: B017  (torch: type(err); any raise)
                fn(*(t for _, t in combo))
        return
    rows = [_layouts(v) for v in values]
    for combo in zip(*rows):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ShardwiseFallbackWarning)
            got = fn(*(t for _, t in combo))
        if what.split()[0] in REORDERS:
            torch.testing.assert_close(_plain(got), want, msg=what)
            continue
        _same(_plain(got), want, f"{what} {[n for n, _ in combo]}")


S = torch.special
# name: (function, shapes of its tensor arguments)
CASES: dict[str, tuple[Callable[..., Any], list[tuple[int, ...]]]] = {
    "diagonal": (lambda x: torch.diagonal(x, 1, 0, 2), [(5, 3, 6)]),
    "diagonal neg": (lambda x: x.diagonal(-2, -1, 0), [(6, 3, 5)]),
    "linalg.diagonal": (lambda x: torch.linalg.diagonal(x, offset=1), [(3, 5, 6)]),
    "diag 1d": (lambda x: torch.diag(x, -2), [(5,)]),
    "diag 2d": (lambda x: torch.diag(x, 1), [(5, 7)]),
    "diag_embed": (lambda x: torch.diag_embed(x, 1, 0, 2), [(3, 5)]),
    "diag_embed default": (torch.diag_embed, [(4, 3, 5)]),
    "diagflat": (lambda x: torch.diagflat(x, -1), [(2, 3)]),
    "trace": (torch.trace, [(5, 7)]),
    "unfold": (lambda x: x.unfold(1, 3, 2), [(3, 9, 2)]),
    "unfold 0-d": (lambda x: x.unfold(0, 1, 1), [()]),
    "select_scatter": (lambda x, s: torch.select_scatter(x, s, 1, -2), [(5, 6, 3), (5, 3)]),
    "slice_scatter": (lambda x, s: torch.slice_scatter(x, s, 1, 1, 6, 2), [(5, 7), (5, 3)]),
    "diagonal_scatter": (lambda x, s: torch.diagonal_scatter(x, s, -1, 0, 1),
                         [(6, 5, 3), (3, 5)]),
    "split_with_sizes": (lambda x: x.split_with_sizes([1, 4, 0, 2], 1), [(3, 7)]),
    "unsafe_split": (lambda x: torch.unsafe_split(x, 3, 0), [(7, 2)]),
    "unsafe_chunk": (lambda x: torch.unsafe_chunk(x, 3, 1), [(2, 7)]),
    "tensor_split n": (lambda x: torch.tensor_split(x, 3, 1), [(2, 7)]),
    "tensor_split idx": (lambda x: torch.tensor_split(x, [5, 2, -1], 0), [(7, 2)]),
    "tensor_split tensor": (lambda x: x.tensor_split(torch.tensor([1, 4]), 1), [(2, 7)]),
    "hsplit": (lambda x: torch.hsplit(x, [1, 3]), [(5, 6, 2)]),
    "vsplit": (lambda x: torch.vsplit(x, 2), [(6, 5)]),
    "dsplit": (lambda x: torch.dsplit(x, [1]), [(2, 3, 4)]),
    "aten.slice": (lambda x: torch.ops.aten.slice.Tensor(x, 1, 1, -2, 3), [(4, 12)]),
    "movedim": (lambda x: torch.movedim(x, (0, -1), (2, 0)), [(5, 3, 6, 2)]),
    "moveaxis": (lambda x: x.moveaxis(1, 0), [(5, 3)]),
    "fliplr": (torch.fliplr, [(5, 6)]), "flipud": (torch.flipud, [(5, 6)]),
    "rot90": (lambda x: torch.rot90(x, 1, (0, 2)), [(5, 3, 6)]),
    "rot90 k=-5": (lambda x: x.rot90(-5, [1, 0]), [(5, 6)]),
    "rot90 k=2": (lambda x: x.rot90(2), [(5, 6)]), "rot90 k=0": (lambda x: x.rot90(0), [(5, 6)]),
    "H": (lambda x: x.to(torch.complex64).H, [(5, 3)]),
    "mH": (lambda x: x.to(torch.complex64).mH, [(2, 5, 3)]),
    "adjoint": (torch.adjoint, [(5, 3)]),
    "broadcast_to": (lambda x: torch.broadcast_to(x, (2, 5, 3)), [(5, 1)]),
    "broadcast_tensors": (torch.broadcast_tensors, [(5, 1), (4, 1, 3)]),
    "ravel": (torch.ravel, [(5, 3)]),
    "atleast_1d": (torch.atleast_1d, [()]), "atleast_2d": (torch.atleast_2d, [(5,)]),
    "atleast_3d": (lambda x, y: torch.atleast_3d([x, y]), [(5, 3), (4,)]),
    "hstack": (lambda x, y: torch.hstack([x, y]), [(5, 3), (5, 2)]),
    "vstack": (lambda x, y: torch.vstack((x, y)), [(3,), (3,)]),
    "dstack": (lambda x, y: torch.dstack([x, y]), [(5, 3), (5, 3, 2)]),
    "column_stack": (lambda x, y: torch.column_stack([x, y]), [(5,), (5, 2)]),
    "row_stack": (lambda x, y: torch.row_stack([x, y]), [(3, 4), (2, 4)]),
    "repeat": (lambda x: x.repeat(2, 1, 3), [(5, 2)]),
    "repeat 0": (lambda x: x.repeat(0, 2), [(5,)]),
    "tile": (lambda x: x.tile((2,)), [(3, 5)]),
    "repeat_interleave dim=None": (lambda x: x.repeat_interleave(2), [(3, 5)]),
    "repeat_interleave tensor": (
        lambda x: torch.repeat_interleave(x, torch.tensor([1, 0, 3, 2, 1]), dim=0), [(5, 3)]),
    "sum_to_size": (lambda x: x.sum_to_size(1, 3), [(2, 5, 3)]),
    "meshgrid ij": (lambda x, y: torch.meshgrid(x, y, indexing="ij"), [(5,), (3,)]),
    "meshgrid xy list": (lambda x, y, z: torch.meshgrid([x, y, z], indexing="xy"),
                         [(5,), (3,), ()]),
    "cartesian_prod": (torch.cartesian_prod, [(5,), (3,)]),
    "combinations": (lambda x: torch.combinations(x, 2), [(5,)]),
    "combinations r=3 w": (lambda x: torch.combinations(x, 3, True), [(3,)]),
    "block_diag": (torch.block_diag, [(2, 3), (3,), ()]),
    "_chunk_cat": (lambda x, y: torch._chunk_cat([x, y], 1, 3), [(2, 5, 2), (2, 4)]),
    "narrow tensor start": (lambda x: x.narrow(1, torch.tensor(-3), 2), [(5, 6)]),
    "transpose 0-d": (lambda x: x.transpose(0, -1), [()]),
}
COPIES: dict[str, tuple[Callable[..., Any], list[tuple[int, ...]]]] = {
    "view_copy": (lambda x: torch.view_copy(x, (3, 10)), [(5, 6)]),
    "permute_copy": (lambda x: torch.permute_copy(x, (1, 0)), [(5, 6)]),
    "t_copy": (torch.t_copy, [(5, 6)]),
    "transpose_copy": (lambda x: torch.transpose_copy(x, 0, 1), [(5, 6)]),
    "squeeze_copy": (lambda x: torch.squeeze_copy(x, 1), [(5, 1, 6)]),
    "unsqueeze_copy": (lambda x: torch.unsqueeze_copy(x, 1), [(5, 6)]),
    "expand_copy": (lambda x: torch.expand_copy(x, (2, 5, 6)), [(5, 1)]),
    "alias_copy": (torch.alias_copy, [(5, 6)]),
    "diagonal_copy": (lambda x: torch.diagonal_copy(x, 1), [(5, 6)]),
    "narrow_copy": (lambda x: x.narrow_copy(1, 2, 3), [(5, 6)]),
    "unbind_copy": (lambda x: torch.unbind_copy(x, 1), [(5, 3)]),
    "unfold_copy": (lambda x: torch.unfold_copy(x, 1, 2, 2), [(5, 6)]),
    "split_with_sizes_copy": (lambda x: torch.split_with_sizes_copy(x, [2, 4], 1), [(5, 6)]),
    "select_copy": (lambda x: torch.select_copy(x, 1, 2), [(5, 6)]),
    "slice_copy": (lambda x: torch.slice_copy(x, 0, 1, 4), [(5, 6)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_views_and_joins_match_torch(name: str) -> None:
    fn, shapes = CASES[name]
    _check(fn, *(_value(s, i) for i, s in enumerate(shapes)), what=name)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float64, torch.complex64])
@pytest.mark.parametrize("name", ["diagonal", "diag_embed", "select_scatter", "repeat",
                                  "hstack", "block_diag", "sum_to_size", "trace", "rot90",
                                  "broadcast_to", "meshgrid ij", "_chunk_cat"])
def test_dtypes(name: str, dtype: torch.dtype) -> None:
    fn, shapes = CASES[name]
    values = [_value(s, i).to(dtype) for i, s in enumerate(shapes)]
    _check(fn, *values, what=f"{name} {dtype}")


@pytest.mark.parametrize("name", sorted(COPIES))
def test_copies_match_torch_and_never_alias(name: str) -> None:
    fn, shapes = COPIES[name]
    v = _value(shapes[0])
    _check(fn, v, what=name)
    for where, x in _layouts(v):
        out = fn(x)
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            o.mul_(0).add_(7)
        assert torch.equal(_bits(x.to_torch()), _bits(v)), f"{name} {where}: aliases"


def test_linear_views_keep_partial_sum() -> None:
    """A diagonal, an embedding, a window: each output element is one input element (or
    zero), so a Partial(SUM) operand stays Partial with no communication."""
    blocks = [_value((4, 4), 1), _value((4, 4), 2)]
    x = sw.from_local(blocks, PlacementMapping(M2, [Partial()]))
    want = blocks[0] + blocks[1]
    for fn in (torch.diagonal, lambda t: t.unfold(0, 2, 1), lambda t: torch.diag_embed(t),
               lambda t: torch.select_scatter(t, t[0], 0, 1)):
        out = fn(x)
        assert out.dist_layout.is_partial
        torch.testing.assert_close(out.to_torch(), fn(want))


def test_bad_arguments_raise_torchs_errors() -> None:
    x = sw.shard(_value((5, 6)), M4, ["x", None])
    for fn in (lambda t: torch.diagonal(t, 0, 1, 1), lambda t: t.unfold(0, 9, 1),
               lambda t: torch.vsplit(t, 2), lambda t: t.repeat(2),
               lambda t: t.split_with_sizes([1, 2], 0), lambda t: t.sum_to_size(4, 6),
               lambda t: torch.rot90(t, 1, (0, 0))):
        with pytest.raises(RuntimeError) as got:
            fn(x)
        with pytest.raises(RuntimeError) as want:
            fn(_value((5, 6)))
        assert str(got.value) == str(want.value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 6), min_size=1, max_size=3), st.integers(0, 2),
       st.one_of(st.integers(1, 4), st.lists(st.integers(-7, 7), max_size=3)),
       st.integers(0, 99))
def test_tensor_split_on_random_shards(shape: list[int], dim: int, arg: Any, seed: int) -> None:
    """Property: tensor_split's pieces (sections or any indices, out of order and
    negative too) are torch's, wherever the split dim is sharded."""
    dim %= len(shape)
    v = _value(tuple(shape), seed)
    want = torch.tensor_split(v, arg, dim)
    spec: list[Any] = [None] * len(shape)
    spec[seed % len(shape)] = ("dp", "tp")
    got = torch.tensor_split(sw.shard(v, M22, spec), arg, dim)
    _same(_plain(got), list(want), f"tensor_split {shape} {arg} dim {dim}")


# --- as_strided: the Tensor's own elements, row-major, are its storage (issue 33) -----------
STRIDED = {
    "offset": lambda t: torch.as_strided(t, (2, 2), (1, 2), 1),
    "overlapping": lambda t: t.as_strided((3, 2), (0, 3), 4),  # one element read thrice
    "larger": lambda t: torch.as_strided(t, (2, 1, 1, 2), (1, 7, 7, 1)),
    "0-d": lambda t: torch.as_strided(t, (), (), 8),
    "empty": lambda t: torch.as_strided(t, (2, 0), (1, 1), 20),
    "copy": lambda t: torch.as_strided_copy(t, (2, 2), (3, 1), 2),
}


@pytest.mark.parametrize("place", [Sharded(0), Sharded(1), Replicated()])
@pytest.mark.parametrize("name", sorted(STRIDED))
def test_as_strided_reads_the_tensors_own_elements(name: str, place: Any) -> None:
    # whole leaves and block leaves: values and gradients are torch's on a contiguous value
    check(STRIDED[name], [(_value((3, 3)), pm(M4, place))])


@pytest.mark.parametrize("place", [Sharded(0), Sharded(1), Replicated()])
def test_as_strided_scatter_writes_the_tensors_own_elements(place: Any) -> None:
    fn = lambda t, s: torch.as_strided_scatter(t, s, (2, 2), (1, 2), 1)  # noqa: E731
    check(fn, [(_value((3, 3)), pm(M4, place)), (_value((2, 2), 1), pm(M4, Replicated()))])
    t = _value((4, 5)).t()  # torch writes in the order of these strides
    for x in (sw.tensor(t, sharding=pm(M4, place)),
              sw.tensor(t, sharding=pm(M4, place), requires_grad=True)):
        with pytest.raises(ShardingError, match=r"Cannot as_strided_scatter .* lies in"):
            torch.as_strided_scatter(x, torch.ones(2, 2), (2, 2), (1, 2))


def _sharing(v: torch.Tensor, place: Any, grad: bool) -> sw.Tensor:
    """``v`` on M4 (1-D) from blocks that are views of ``v`` itself (from_local)."""
    blocks = [v] * 4 if place == Replicated() else list(v.split([3, 3, 2, 2]))
    return sw.from_local(blocks, PlacementMapping(M4, [place]), tuple(v.shape),
                         requires_grad=grad)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("place", [Sharded(0), Replicated()])
def test_as_strided_on_a_view_is_torchs_or_refused(place: Any, grad: bool) -> None:
    # torch's partial_views sample: base[5:15] lies at storage offset 5 of base's storage
    base = _value((20,))
    view = base[5:15].detach().requires_grad_(grad)
    x = _sharing(base[5:15], place, grad)
    got, want = torch.as_strided(x, (2, 2), (1, 2)), torch.as_strided(view, (2, 2), (1, 2))
    assert torch.equal(got.to_torch(), want)  # the default offset is the view's own
    if grad:
        w = _value((2, 2), 5)
        (got.to_torch() * w).sum().backward()
        (want * w).sum().backward()
        torch.testing.assert_close(x.grad.to_torch(), view.grad)
    with pytest.raises(ShardingError, match=r"Cannot as_strided .*storage offset 5,"):
        torch.as_strided(x, (2, 2), (1, 2), 0)  # torch reads base[0:4]: not x's elements
    with pytest.raises(ShardingError, match=r"its own 10 elements.*storage position 13"):
        torch.as_strided(x, (2, 2), (1, 2), 10)  # x's storage is its own 10 elements
    with pytest.raises(ShardingError, match=r"its own 10 elements"):
        torch.as_strided(x, (2,), (10**12,))  # refused before any position is listed
    # as_strided_scatter writes where as_strided reads (into a copy of the view)
    src = _value((2, 2), 6)
    assert torch.equal(torch.as_strided_scatter(x, src, (2, 2), (1, 2)).to_torch(),
                       torch.as_strided_scatter(view, src, (2, 2), (1, 2)))
    with pytest.raises(ShardingError, match=r"Cannot as_strided_scatter .*storage offset 5,"):
        torch.as_strided_scatter(x, src, (2, 2), (1, 2), 4)  # torch drops one: base[4]


def test_as_strided_refuses_where_torch_would_read_elsewhere() -> None:
    base = _value((4, 5))
    for place in (Sharded(0), Sharded(1), Replicated()):
        mapping = PlacementMapping(M4, [place])
        for x in (sw.tensor(base, sharding=mapping)[1:3],  # a view: storage offset 5
                  sw.tensor(base.t(), sharding=mapping),  # torch's clone keeps the strides
                  sw.tensor(base.t(), sharding=mapping, requires_grad=True)):
            with pytest.raises(ShardingError, match="lies in memory as torch laid it out"):
                torch.as_strided(x, (2, 2), (1, 2), 0)
        blocks = sw.tensor(base.t(), sharding=mapping, requires_grad=True) * 2
        if place != Replicated():  # separate buffers: in what order would torch lay it?
            with pytest.raises(ShardingError, match="no one tensor holds this value"):
                torch.as_strided(blocks, (2, 2), (1, 2))
