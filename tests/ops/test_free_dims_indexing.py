"""gather, scatter, index_*, take, put, searchsorted, isin and ``x[i] = v`` on shardwise
Tensors: value and gradient equal single-device torch over several layouts (uneven and
size-0 blocks), with no fallback."""

from __future__ import annotations

import warnings

import pytest
import torch

import shardwise as sw
from shardwise import Sharded
from tests.helpers.computecheck import LINE, lay, run, values
from tests.helpers.meshes import M4
from tests.helpers.opcheck import R, check, pm

R2, S0, S1 = lay(LINE, None, None), lay(LINE, "x", None), lay(LINE, None, "x")
SHAPES = [(5, 6), (3, 4)]  # uneven, size-0 blocks over 4 devices


@pytest.fixture(autouse=True)
def _strict():  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("error", sw.ShardwiseFallbackWarning)
        yield


def index_for(shape: tuple[int, int], dim: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape[dim], shape, generator=gen)


CASES = [
    ("gather", lambda x, i: torch.gather(x, 1, i)),
    ("gather dim0", lambda x, i: torch.gather(x, 0, i)),
    ("scatter", lambda x, i: torch.scatter(x, 1, i, x * 2)),
    ("scatter_add", lambda x, i: torch.scatter_add(x, 0, i, x)),
    ("scatter_reduce", lambda x, i: x.scatter_reduce(1, i, x, "amax", include_self=False)),
    ("take", lambda x, i: torch.take(x, i)),
    ("take_along_dim", lambda x, i: torch.take_along_dim(x, i, 1)),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gather_scatter(case: tuple, shape: tuple[int, int]) -> None:
    _, fn = case
    x = values(*shape)
    i = index_for(shape, 0 if "dim0" in case[0] or "add" in case[0] else 1)
    for lx in (S0, S1, R2):
        for li in (S0, S1, R2):
            run(fn, fn, [(x, lx), (i, li)])


INDEX = [
    ("index_add", lambda x, s: x.index_add(1, torch.tensor([0, 2, 0]), s, alpha=2)),
    ("index_copy", lambda x, s: x.index_copy(1, torch.tensor([3, 1, 0]), s)),
    ("index_fill", lambda x, s: x.index_fill(1, torch.tensor([1, 2]), -1.0) + s.sum()),
    ("index_reduce", lambda x, s: x.index_reduce(1, torch.tensor([0, 0, 2]), s, "prod")),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", INDEX, ids=[c[0] for c in INDEX])
def test_index_family(case: tuple, shape: tuple[int, int]) -> None:
    _, fn = case
    x, s = values(*shape), values(shape[0], 3, seed=1)
    for lx in (S0, S1, R2):
        for ls in (S0, S1):
            run(fn, fn, [(x, lx), (s, ls)])


def test_search_and_isin() -> None:
    seq = torch.tensor([0.0, 0.5, 1.0, 2.0], dtype=torch.float64)
    v = values(5, 3)
    for lv in (lay(LINE, "x", None), lay(LINE, None, "x")):
        run(lambda a, b: torch.searchsorted(a, b), lambda a, b: torch.searchsorted(a, b),
            [(seq, lay(LINE, "x")), (v, lv)], grad=False)
        run(lambda a, b: torch.bucketize(a, b, right=True),
            lambda a, b: torch.bucketize(a, b, right=True),
            [(v, lv), (seq, lay(LINE, None))], grad=False)
        ints = torch.arange(15).reshape(5, 3) % 7
        run(torch.isin, torch.isin, [(ints, lv), (torch.tensor([1, 3, 5]), lay(LINE, "x"))],
            grad=False)


SETITEM = [
    (1, 3.0),
    ((slice(None), 2), torch.arange(5.0, dtype=torch.float64)),
    (slice(1, 4), torch.ones(6, dtype=torch.float64)),
    ((slice(None), slice(1, 3)), torch.ones(5, 1, dtype=torch.float64)),
    (torch.tensor([0, 2]), 7.0),
    ((Ellipsis, 0), torch.arange(5.0, dtype=torch.float64)),
    ((None, 2), -1.0),
    (torch.tensor([1, 3]), torch.ones(2, 6, dtype=torch.float64)),
]


@pytest.mark.parametrize("case", range(len(SETITEM)))
def test_setitem(case: int) -> None:
    """``x[i] = v`` lands in x's own shards (its layout kept), as torch writes it."""
    idx, v = SETITEM[case]
    base = values(5, 6)
    ref = base.clone()
    ref[idx] = v
    for lx in (S0, S1, R2):
        x = sw.tensor(base.clone(), sharding=lx)
        x[idx] = v
        assert torch.equal(x.to_torch(), ref) and x.dist_layout == lx
        if isinstance(v, torch.Tensor) and v.ndim:
            x = sw.tensor(base.clone(), sharding=lx)
            x[idx] = sw.tensor(v, sharding=lay(LINE, "x", *[None] * (v.ndim - 1)))
            assert torch.equal(x.to_torch(), ref)
    mask = base > 0
    ref = base.clone()
    ref[mask] = 0.0
    x = sw.tensor(base.clone(), sharding=S0)
    x[sw.tensor(mask, sharding=S1)] = 0.0
    assert torch.equal(x.to_torch(), ref)


@pytest.mark.parametrize("lx", [S0, R2])
def test_setitem_autograd(lx: object) -> None:
    a, v = values(5, 6).requires_grad_(), values(6, seed=1).requires_grad_()
    r = a * 2
    r[2] = v * 3
    (r * values(5, 6, seed=2)).sum().backward()
    A = sw.tensor(a.detach(), sharding=lx, requires_grad=True)
    V = sw.tensor(v.detach(), sharding=lay(LINE, "x"), requires_grad=True)
    R = A * 2
    R[2] = V * 3
    (R * sw.tensor(values(5, 6, seed=2), sharding=lx)).sum().backward()
    assert torch.equal(A.grad.to_torch(), a.grad)
    assert torch.equal(V.grad.to_torch(), v.grad)


def test_setitem_leaf_refused_like_torch() -> None:
    a = values(4, 3).requires_grad_()
    with pytest.raises(RuntimeError) as want:
        a[0] = 1.0
    x = sw.tensor(values(4, 3), sharding=S0).requires_grad_()
    with pytest.raises(RuntimeError) as got:
        x[0] = 1.0
    assert "leaf" in str(want.value) and "leaf" in str(got.value)


# --- issue 33: samples as torch's OpInfo gives them -------------------------------------------
PLACES = [Sharded(0), Sharded(1), R]


@pytest.mark.parametrize("pi", PLACES)
@pytest.mark.parametrize("px", PLACES)
def test_take_along_dim_without_dim_flattens_both(px: object, pi: object) -> None:
    # torch flattens x and the indices: (5, 5) and (5, 2) give (10,), not take's (5, 2)
    gen = torch.Generator().manual_seed(0)
    x, i = values(5, 5), torch.randint(0, 25, (5, 2), generator=gen)
    check(torch.take_along_dim, [(x, pm(M4, px)), (i, pm(M4, pi))])


@pytest.mark.parametrize("pi", PLACES)
@pytest.mark.parametrize("px", PLACES)
def test_take_along_dim_counts_negative_indices_from_the_end(px: object, pi: object) -> None:
    gen = torch.Generator().manual_seed(1)
    x, i = values(5, 5), torch.randint(-5, 5, (5, 5), generator=gen)
    check(lambda a, b: torch.take_along_dim(a, b, 1), [(x, pm(M4, px)), (i, pm(M4, pi))])
    check(lambda a, b: torch.take_along_dim(a, b, dim=-1), [(x, pm(M4, px)), (i, pm(M4, pi))])


@pytest.mark.parametrize("px", [Sharded(0), R])
def test_gather_takes_an_empty_index_of_another_rank(px: object) -> None:
    # torch takes an empty index of any rank (it raised IndexError inside shardwise)
    x = values(5)
    for index in (torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)):
        for pi in (Sharded(0), R):
            check(lambda a, b: torch.gather(a, 0, b), [(x, pm(M4, px)), (index, pm(M4, pi))])


def test_gather_of_0d_values_and_indices() -> None:
    x = values(1).reshape(())
    for index in (torch.tensor(0), torch.tensor([0, 0])):
        check(lambda a, b: torch.gather(a, 0, b), [(x, pm(M4, R)), (index, pm(M4, R))])
