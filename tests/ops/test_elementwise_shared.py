"""torch's other elementwise ops (the shared ``elementwise`` rule, issue 20) on sharding
rules: values bit-identical to torch's on the global tensor, torch's dtype and shape, no
fallback, over whole values and blocks, uneven and empty shards, broadcasting, and in
place (``x.acos_()``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise import PlacementMapping, Replicated, Sharded
from shardwise.ops.registry import ShardwiseFallbackWarning
from tests.helpers.meshes import M4, M22

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
S = torch.special
# unary ops on floats in (0.05, 0.95): inside every domain (erfinv, atanh, ndtri...)
UNARY: dict[str, Callable[[Any], Any]] = {
    "acos": torch.acos, "acosh": lambda x: torch.acosh(x + 1), "asin": torch.asin,
    "asinh": torch.asinh, "atan": torch.atan, "atanh": torch.atanh, "arccos": torch.arccos,
    "cosh": torch.cosh, "sinh": torch.sinh, "tan": torch.tan, "sinc": torch.sinc,
    "deg2rad": torch.deg2rad, "rad2deg": torch.rad2deg, "i0": torch.i0, "erfc": torch.erfc,
    "erfinv": torch.erfinv, "digamma": torch.digamma, "lgamma": torch.lgamma,
    "mvlgamma": lambda x: torch.mvlgamma(x + 2, 3), "polygamma": lambda x: torch.polygamma(2, x),
    "x.polygamma": lambda x: x.polygamma(1), "signbit": torch.signbit,
    "isposinf": torch.isposinf, "isneginf": torch.isneginf, "isreal": torch.isreal,
    "angle": torch.angle, "conj_physical": torch.conj_physical, "fix": torch.fix,
    "real": torch.real, "x.real": lambda x: x.real, "x.imag": lambda x: x.to(torch.cfloat).imag,
    "fill": lambda x: torch.fill(x, 2.5), "celu": F.celu, "selu": F.selu,
    "rrelu eval": lambda x: F.rrelu(x - 0.5), "softshrink": lambda x: F.softshrink(x, 0.3),
    "hardshrink": lambda x: torch.hardshrink(x, 0.3),
    "i0e": S.i0e, "i1": S.i1, "i1e": S.i1e, "ndtr": S.ndtr, "ndtri": S.ndtri,
    "log_ndtr": S.log_ndtr, "erfcx": S.erfcx, "entr": S.entr, "gammaln": S.gammaln,
    "psi": S.psi, "airy_ai": S.airy_ai, "bessel_j0": S.bessel_j0, "bessel_y1": S.bessel_y1,
    "modified_bessel_k0": S.modified_bessel_k0,
    "scaled_modified_bessel_k1": S.scaled_modified_bessel_k1,
    "spherical_bessel_j0": S.spherical_bessel_j0,
    "byte": lambda x: (x * 10).byte(), "char": lambda x: (x * 10).char(),
    "short": lambda x: (x * 10).short(), "cfloat": lambda x: x.cfloat(),
    "cdouble": lambda x: x.cdouble(), "chalf": lambda x: x.chalf(),
}
BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "logaddexp": torch.logaddexp, "logaddexp2": torch.logaddexp2,
    "ldexp": lambda x, y: torch.ldexp(x, (y * 4).int()), "heaviside": torch.heaviside,
    "lcm": lambda x, y: torch.lcm((x * 20).long(), (y * 30).long()),
    "gcd": lambda x, y: torch.gcd((x * 20).int(), (y * 30).int()),
    "nextafter": torch.nextafter, "igamma": torch.igamma, "igammac": torch.igammac,
    "isclose": lambda x, y: torch.isclose(x, y, 0.5, 0.1), "complex": torch.complex,
    "polar": torch.polar, "rsub": lambda x, y: torch.rsub(x, y, alpha=2),
    "xlog1py": S.xlog1py, "zeta": lambda x, y: S.zeta(x + 1, y),
    "chebyshev_polynomial_t": lambda x, y: S.chebyshev_polynomial_t(x, 3),
    "hermite_polynomial_h": lambda x, y: S.hermite_polynomial_h(x, (y * 5).long()),
    "legendre_polynomial_p": S.legendre_polynomial_p, "gammainc": S.gammainc,
}


def _value(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen) * 0.9 + 0.05


def _layouts(v: torch.Tensor) -> list[tuple[str, sw.Tensor]]:
    """``v`` whole (Sharded(0) on 4 devices) and as blocks: Sharded on its last dim over
    both axes of a 2x2 mesh (uneven, some empty), and Replicated."""
    last = v.ndim - 1
    return [("S(0) whole", sw.tensor(v, sharding=PlacementMapping(M4, [Sharded(0)]))),
            ("S(-1) blocks", sw.shard(v, M22, [None] * last + [("dp", "tp")])),
            ("R blocks", sw.shard(v, M22, [None] * v.ndim)),
            ("S(0) whole R", sw.tensor(v, sharding=PlacementMapping(M4, [Replicated()])))]


# torch's CPU kernels of these ops round the vectorized body and the scalar tail of a
# buffer differently (as sigmoid's and gelu's do): on blocks, the last bit may differ
# from the whole tensor's wherever a block boundary moves an element between the two
VECTOR_TAIL = {"atanh", "cosh", "sinh", "logaddexp", "logaddexp2", "xlog1py", "igamma",
               "igammac", "gammainc", "gammaincc"}


def _same(got: Any, want: torch.Tensor, what: str) -> None:
    assert isinstance(got, sw.Tensor), f"{what}: {type(got).__name__}"
    g = got.to_torch()
    assert g.dtype == want.dtype, f"{what}: dtype {g.dtype}, torch {want.dtype}"
    assert g.shape == want.shape, f"{what}: shape {tuple(g.shape)}, torch {tuple(want.shape)}"
    if what.split()[0] in VECTOR_TAIL:  # a few ulps, never more
        torch.testing.assert_close(g, want, rtol=4 * torch.finfo(g.dtype).eps, atol=0,
                                   equal_nan=True, msg=what)
        return
    # bit-identical, NaNs where torch has them
    assert torch.equal(torch.view_as_real(g) if g.is_complex() else g,
                       torch.view_as_real(want) if want.is_complex() else want) or (
        want.is_floating_point() and torch.equal(g.isnan(), want.isnan())
        and torch.equal(g[~g.isnan()], want[~want.isnan()])), f"{what}: {g} vs {want}"


def _no_fallback(fn: Callable[..., Any], *args: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardwiseFallbackWarning)
        return fn(*args)


SHAPES = [(5, 7), (3, 0), (1, 6), (6,)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_bit_identical(name: str, shape: tuple[int, ...]) -> None:
    v = _value(shape, 0)
    want = UNARY[name](v)
    for where, x in _layouts(v):
        _same(_no_fallback(UNARY[name], x), want, f"{name} {where} {shape}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_bit_identical_with_broadcast(name: str, shape: tuple[int, ...]) -> None:
    a, b = _value(shape, 0), _value(shape[1:] or shape, 1)  # b broadcasts
    want = BINARY[name](a, b)
    for (where, x), (_, y) in zip(_layouts(a), _layouts(b)):
        _same(_no_fallback(BINARY[name], x, y), want, f"{name} {where} {shape}")
        _same(_no_fallback(BINARY[name], x, b), want, f"{name} {where}, torch b {shape}")


def test_frexp_two_outputs() -> None:
    v = (_value((5, 6), 0) - 0.5) * 100
    want = torch.frexp(v)
    for where, x in _layouts(v):
        got = _no_fallback(torch.frexp, x)
        _same(got.mantissa, want.mantissa, f"frexp mantissa {where}")
        _same(got[1], want.exponent, f"frexp exponent {where}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dtypes_follow_torch(dtype: torch.dtype) -> None:
    v = _value((6, 5), 2).to(dtype)
    for name in ("acos", "lgamma", "signbit", "i0e", "deg2rad", "erfinv"):
        want = UNARY[name](v)
        for where, x in _layouts(v):
            _same(_no_fallback(UNARY[name], x), want, f"{name} {dtype} {where}")


@pytest.mark.parametrize("name", ["acos", "asinh", "tan", "sinc", "erfinv", "lgamma",
                                  "digamma", "i0", "deg2rad", "rad2deg", "fix"])
def test_inplace_variants(name: str) -> None:
    v = _value((5, 7), 3)
    want = getattr(v.clone(), name + "_")()
    for where, x in _layouts(v):
        got = _no_fallback(getattr(x, name + "_"))
        assert got is x
        _same(x, want, f"{name}_ {where}")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(UNARY)), st.lists(st.integers(0, 5), min_size=1, max_size=3),
       st.integers(0, 1), st.integers(0, 99))
def test_shared_rule_on_random_shards(name: str, shape: list[int], mesh_kind: int,
                                      seed: int) -> None:
    """Property: any op of the shared rule, any shape (empty and uneven shards), a
    random dim sharded over one or two mesh axes, gives torch's bits."""
    v = _value(tuple(shape), seed)
    dim = seed % len(shape)
    spec: list[Any] = [None] * len(shape)
    spec[dim] = ("dp", "tp") if mesh_kind else "x"
    x = sw.shard(v, M22 if mesh_kind else M4, spec)
    _same(_no_fallback(UNARY[name], x), UNARY[name](v), f"{name} {shape} dim {dim}")


@pytest.mark.parametrize("shape", [(5, 7), (3, 0), (6,)])
def test_unravel_index_and_one_hot(shape: tuple[int, ...]) -> None:
    ids = (_value(shape, 5) * 40).long()
    for where, x in _layouts(ids.float()):
        x = x.long()
        got = _no_fallback(torch.unravel_index, x, (7, 6))
        for g, w in zip(got, torch.unravel_index(ids, (7, 6))):
            _same(g, w, f"unravel_index {where}")
        _same(_no_fallback(F.one_hot, x, 40), F.one_hot(ids, 40), f"one_hot {where}")
        if ids.numel():
            _same(_no_fallback(F.one_hot, x), F.one_hot(ids), f"one_hot -1 {where}")
        else:
            with pytest.raises(RuntimeError):
                F.one_hot(x)


@pytest.mark.parametrize("wshape", [(6,), (1,), ()])
def test_prelu_slopes_shard_with_the_channels(wshape: tuple[int, ...]) -> None:
    v, w = _value((4, 6, 5), 6) - 0.5, _value(wshape, 7)
    want = F.prelu(v, w)
    for where, x in _layouts(v):
        _same(_no_fallback(F.prelu, x, w), want, f"prelu {where} {wshape}")
    # x and its per-channel slopes both sharded on the channels: no communication
    x = sw.shard(v, M22, [None, ("dp", "tp"), None])
    if wshape == (6,):
        ws = sw.shard(w, M22, [("dp", "tp")])
        out = _no_fallback(F.prelu, x, ws)
        assert out.dist_layout == x.dist_layout
        _same(out, want, "prelu channel-sharded")
