"""Batched linalg and the matmul family on rules (no fallback): values and gradients
equal plain torch over even, uneven and size-0 shards of the batch, whole values bit
for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise import Sharded
from tests.helpers.meshes import M4, M24
from tests.helpers.opcheck import R, check, pm

S0, S1, S2 = Sharded(0), Sharded(1), Sharded(2)
BATCHES = [5, 8, 2, 0]  # uneven, even, size-0 shards, an empty batch over 4 devices


def spd(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*shape, generator=g, dtype=torch.float64)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1], dtype=torch.float64)


def rand(*shape: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


ONE = [  # (name, fn) of a batch of square matrices
    ("det", torch.linalg.det), ("slogdet", torch.linalg.slogdet), ("logdet", torch.logdet),
    ("inv", torch.linalg.inv), ("inv_ex", torch.linalg.inv_ex),
    ("cholesky", torch.linalg.cholesky), ("cholesky_ex", torch.linalg.cholesky_ex),
    ("eigh", torch.linalg.eigh), ("eigvalsh", torch.linalg.eigvalsh),
    ("qr", torch.linalg.qr), ("svdvals", torch.linalg.svdvals),
    ("lu_factor", torch.linalg.lu_factor), ("lu", torch.linalg.lu),
    ("matrix_exp", torch.linalg.matrix_exp),
    ("matrix_power", lambda a: torch.linalg.matrix_power(a, 3)),
    ("pinv", torch.linalg.pinv), ("cond", torch.linalg.cond),
    ("matrix_rank", torch.linalg.matrix_rank), ("matrix_norm", torch.linalg.matrix_norm),
    ("matrix_norm nuc dims", lambda a: torch.linalg.matrix_norm(a, "nuc", dim=(0, 2))),
    ("norm dim", lambda a: torch.linalg.norm(a, dim=(1, 2))),
    ("cholesky_inverse", torch.cholesky_inverse), ("det method", lambda a: a.det()),
]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name,fn", ONE, ids=[n for n, _ in ONE])
def test_batched_one_matrix(name: str, fn, batch: int) -> None:
    a = spd(batch, 3, 3)
    for mapping in (pm(M4, S0), pm(M4, R), pm(M24, S0, R)):
        check(fn, [(a, mapping)], grad=name not in ("matrix_rank", "lu_factor", "lu"))


TWO = [  # (name, fn, shape of the second operand past the batch)
    ("solve", torch.linalg.solve, (3, 2)), ("solve vector", torch.linalg.solve, (3,)),
    ("solve_ex", torch.linalg.solve_ex, (3, 2)),
    ("solve_triangular", lambda a, b: torch.linalg.solve_triangular(a, b, upper=False),
     (3, 4)),
    ("cholesky_solve", lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(a)), (3, 2)),
    ("lstsq", lambda a, b: torch.linalg.lstsq(a, b).solution, (3, 2)),
]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name,fn,rhs", TWO, ids=[n for n, _, _ in TWO])
def test_batched_two(name: str, fn, rhs: tuple[int, ...], batch: int) -> None:
    a, b = spd(batch, 3, 3), rand(batch, *rhs)
    for ma, mb in ((pm(M4, S0), pm(M4, S0)), (pm(M4, S0), pm(M4, R)),
                   (pm(M4, R), pm(M4, S0))):
        # lstsq's kernel differs with and without autograd: not bitwise even in torch
        check(fn, [(a, ma), (b, mb)], exact_whole=name != "lstsq")


def test_lu_solve_and_unpack_take_pivots() -> None:
    a, b = spd(5, 3, 3), rand(5, 3, 2)
    lu, piv = torch.linalg.lu_factor(a)
    check(lambda x, p, y: torch.linalg.lu_solve(x, p, y),
          [(lu, pm(M4, S0)), (piv, pm(M4, S0)), (b, pm(M4, R))])
    check(lambda x, p: torch.lu_unpack(x, p), [(lu, pm(M4, S0)), (piv, pm(M4, S0))])


def test_batch_broadcasts() -> None:
    a, b = spd(4, 1, 3, 3), rand(5, 3, 2)  # (4, 1) x (5,) -> (4, 5)
    check(torch.linalg.solve, [(a, pm(M4, S0)), (b, pm(M4, S0))])


def test_unbatched_and_whole_ops() -> None:
    a = spd(4, 4)
    for fn in (torch.linalg.inv, torch.linalg.eigh, torch.cov, torch.corrcoef, torch.pinverse):
        check(fn, [(a, pm(M4, S0))])
    x = rand(6, 5)
    check(torch.cov, [(x, pm(M4, S1))])
    check(lambda v: torch.linalg.vander(v, N=3), [(rand(5, 2), pm(M4, S0))])


@pytest.mark.parametrize("shape, place", [((5,), S0), ((2, 5), S1), ((2, 5), S0)])
def test_vander_defaults_to_the_global_last_dim(shape: tuple[int, ...], place: Sharded
                                                ) -> None:
    # N defaults to x.shape[-1]: a block of a sharded last dim holds only part of it
    # (block leaves asserted a (2, 2) block where the layout gives (2, 5), issue 33)
    check(torch.linalg.vander, [(rand(*shape), pm(M4, place))])


MATMUL = [  # (name, fn, operand shapes, placements per operand)
    ("addmm", lambda i, a, b: torch.addmm(i, a, b, beta=0.5, alpha=2), [(6,), (5, 3), (3, 6)],
     [S0, S0, S1]),
    ("addmm 2d input", torch.addmm, [(5, 1), (5, 3), (3, 6)], [R, S0, S1]),
    ("addmv", torch.addmv, [(5,), (5, 3), (3,)], [S0, S0, R]),
    ("addr", torch.addr, [(5, 6), (5,), (6,)], [S1, S0, S0]),
    ("baddbmm", torch.baddbmm, [(5, 2, 4), (5, 2, 3), (5, 3, 4)], [S0, S0, S0]),
    ("addbmm", torch.addbmm, [(2, 4), (5, 2, 3), (5, 3, 4)], [S1, S0, S0]),
    ("dot", torch.dot, [(7,), (7,)], [S0, S0]),
    ("vdot", torch.vdot, [(7,), (7,)], [S0, R]),
    ("mv", torch.mv, [(5, 7), (7,)], [S1, S0]),
    ("outer", torch.outer, [(5,), (6,)], [S0, S0]),
    ("inner", torch.inner, [(2, 5, 3), (4, 3)], [S2, S1]),
    ("kron", torch.kron, [(4, 3), (2, 5)], [S0, S0]),
    ("tensordot", lambda a, b: torch.tensordot(a, b, ([0, 1], [2, 0])), [(2, 5, 3), (5, 4, 2)],
     [S1, S0]),
    ("multi_dot", lambda a, b, c: torch.linalg.multi_dot([a, b, c]), [(5, 3), (3, 4), (4, 6)],
     [S0, S0, S1]),
    ("vecdot", lambda a, b: torch.linalg.vecdot(a, b, dim=0), [(5, 3), (5, 1)], [S0, S0]),
    ("bilinear", F.bilinear, [(5, 3), (5, 4), (6, 3, 4), (6,)], [S0, S0, S0, S0]),
    ("cdist", torch.cdist, [(2, 5, 3), (2, 6, 3)], [S1, S1]),
    ("dist", lambda a, b: torch.dist(a, b, 3), [(5, 3), (3,)], [S0, S0]),
    ("pairwise_distance", F.pairwise_distance, [(5, 3), (5, 3)], [S0, S1]),
    ("cosine_similarity", F.cosine_similarity, [(5, 3, 2), (1, 3, 2)], [S0, S1]),
    ("normalize", lambda a: F.normalize(a, dim=1), [(5, 3)], [S0]),
    ("cross", lambda a, b: torch.linalg.cross(a, b, dim=1), [(5, 3, 2), (5, 3, 2)], [S0, S2]),
    ("trapezoid", lambda y: torch.trapezoid(y, dim=0), [(5, 6)], [S1]),
    ("trapezoid x", lambda y, x: torch.trapezoid(y, x, dim=0), [(5, 6), (5, 6)], [S0, S1]),
    ("cumulative_trapezoid", lambda y: torch.cumulative_trapezoid(y, dim=1), [(5, 6)], [S0]),
    ("diff", lambda x, p: torch.diff(x, 2, 0, prepend=p), [(5, 6), (1, 6)], [S1, R]),
    ("gradient", lambda x: torch.gradient(x, dim=1), [(5, 6)], [S0]),
]


@pytest.mark.parametrize("name,fn,shapes,places", MATMUL, ids=[m[0] for m in MATMUL])
def test_matmul_family(name: str, fn, shapes, places) -> None:
    ins = [(rand(*s, seed=i), pm(M4, p)) for i, (s, p) in enumerate(zip(shapes, places))]
    check(fn, ins, exact_whole=True)
    check(fn, [(v, pm(M4, R)) for v, _ in ins])


def test_partial_dot_stays_partial() -> None:
    """A sharded contracted dim leaves Partial(SUM): no communication in the op."""
    import shardwise as sw
    from shardwise.debug import CommCounter
    a, b = rand(8), rand(8, seed=2)
    x = sw.tensor(a, sharding=pm(M4, S0))
    y = sw.tensor(b, sharding=pm(M4, S0))
    with CommCounter() as cc:
        out = torch.dot(x, y)
    assert not cc.counts and out.dist_layout.is_partial
    torch.testing.assert_close(out.to_torch(), torch.dot(a, b))
