"""Statistics (var_mean, aminmax, kthvalue, quantile, cummax, histc...) and losses on
rules (no fallback): values and gradients equal plain torch over even, uneven and
size-0 shards, whole values bit for bit; a sharded batch's mean is exact up to the
order of the sum."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from shardwise import Sharded
from tests.helpers.meshes import M4, M24
from tests.helpers.opcheck import R, check, pm

S0, S1 = Sharded(0), Sharded(1)
SHAPES = [(5, 6), (8, 4), (2, 3), (0, 3)]  # uneven, even, size-0 shards, empty


def rand(*shape: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


STATS = [
    ("var_mean", lambda x: torch.var_mean(x, 1)),
    ("std_mean all", lambda x: torch.std_mean(x, correction=0)),
    ("var_mean keepdim", lambda x: torch.var_mean(x, 0, keepdim=True)),
    ("aminmax", lambda x: torch.aminmax(x, dim=1)),
    ("nanmean", lambda x: torch.nanmean(x, 1)),
    ("cummax", lambda x: torch.cummax(x, 1)),
    ("cummin", lambda x: torch.cummin(x, 0)),
    ("logcumsumexp", lambda x: torch.logcumsumexp(x, 1)),
    ("kthvalue", lambda x: torch.kthvalue(x, 1, 1)),
    ("mode", lambda x: torch.mode(x, 1)),
    ("quantile", lambda x: torch.quantile(x, 0.3, dim=1)),
    ("quantile q", lambda x: torch.quantile(x, torch.tensor([0.2, 0.9], dtype=x.dtype),
                                            dim=1, keepdim=True)),
    ("nanquantile", lambda x: torch.nanquantile(x, 0.5, dim=1)),
    ("msort", torch.msort),
    ("histc", lambda x: torch.histc(x, 7, -2, 2)),
    ("softmin", lambda x: F.softmin(x, 1)),
    ("glu", lambda x: F.glu(x, 1)),
    ("norm nuc", lambda x: torch.norm(x, "nuc")),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name,fn", STATS, ids=[n for n, _ in STATS])
def test_statistics(name: str, fn, shape: tuple[int, int]) -> None:
    if name in ("glu",) and shape[1] % 2:
        shape = (shape[0], shape[1] + 1)
    x = rand(*shape)
    try:
        fn(x)
    except RuntimeError as torch_error:  # torch refuses an empty input: shardwise too,
        for mapping in (pm(M4, S0), pm(M4, S1), pm(M24, S0, S1)):  # with torch's reason
            with pytest.raises((RuntimeError, sw.ShardingError), match=re.escape(
                    str(torch_error).splitlines()[0])):
                fn(sw.tensor(x, sharding=mapping))
        return
    for mapping in (pm(M4, S0), pm(M4, S1), pm(M24, S0, S1)):
        check(fn, [(x, mapping)], grad=name != "histc")


def test_histc_sums_partial_counts() -> None:
    x = rand(9, 5)
    t = sw.tensor(x, sharding=pm(M4, S0))
    out = torch.histc(t, 6, -1, 1)
    assert out.dist_layout.is_partial  # each device counted its block
    assert torch.equal(out.to_torch(), torch.histc(x, 6, -1, 1))


def test_softmax_backward_data_and_safe_softmax() -> None:
    x = rand(5, 6)
    y = torch.softmax(x, 1)
    check(lambda g, o: torch._softmax_backward_data(g, o, 1, torch.float64),
          [(x, pm(M4, S0)), (y, pm(M4, S0))], grad=False)
    check(lambda v: torch.ops.aten._safe_softmax.default(v, 1), [(x, pm(M4, S0))])


def _target(n: int, classes: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, classes, (n,), generator=g)


LOSSES = [  # (name, fn, operand shapes and kinds)
    ("bce", F.binary_cross_entropy, "prob prob"),
    ("bce weight sum", lambda a, b, w: F.binary_cross_entropy(a, b, w, reduction="sum"),
     "prob prob pos"),
    ("bce_with_logits", lambda a, b, w: F.binary_cross_entropy_with_logits(
        a, b, pos_weight=w), "x prob row"),
    ("smooth_l1", lambda a, b: F.smooth_l1_loss(a, b, beta=0.5), "x x"),
    ("huber none", lambda a, b: F.huber_loss(a, b, reduction="none", delta=0.3), "x x"),
    ("soft_margin", F.soft_margin_loss, "x sign"),
    ("kl_div batchmean", lambda a, b: F.kl_div(a, b, reduction="batchmean"), "x prob"),
    ("margin_ranking", F.margin_ranking_loss, "x x sign"),
    ("hinge_embedding", F.hinge_embedding_loss, "x sign"),
    ("poisson_nll", F.poisson_nll_loss, "x pos"),
    ("gaussian_nll", F.gaussian_nll_loss, "x x pos"),
    ("gaussian_nll per sample var", F.gaussian_nll_loss, "x x var"),
    ("multilabel_soft_margin", F.multilabel_soft_margin_loss, "x prob"),
    ("triplet", F.triplet_margin_loss, "x x x"),
    ("triplet distance", lambda a, b, c: F.triplet_margin_with_distance_loss(
        a, b, c, distance_function=nn.PairwiseDistance()), "x x x"),
    ("cross_entropy soft", lambda a, b: F.cross_entropy(a, b.softmax(1)), "x x"),
]


def _value(kind: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    v = rand(*shape, seed=seed)
    return {"x": v, "prob": v.sigmoid(), "pos": v.abs() + 0.1, "sign": v.sign(),
            "row": v[0].abs() + 0.1, "var": v[:, 0].abs() + 0.1}[kind]


@pytest.mark.parametrize("shape", [(5, 6), (2, 4)], ids=str)
@pytest.mark.parametrize("name,fn,kinds", LOSSES, ids=[n for n, _, _ in LOSSES])
def test_losses(name: str, fn, kinds: str, shape: tuple[int, int]) -> None:
    vals = [_value(k, shape, i) for i, k in enumerate(kinds.split())]
    for p in (S0, S1, R):
        # torch takes no gradient for targets and weights of most losses
        check(fn, [(v, pm(M4, p if v.ndim == 2 else (S0 if p == S0 else R))) for v in vals],
              exact_whole=False, grad=2 if name.startswith(("gaussian", "margin", "triplet",
                                                           "kl", "cross")) else 1)


CLASS = [
    ("nll", lambda x, t, w: F.nll_loss(F.log_softmax(x, 1), t)),
    ("nll weight", lambda x, t, w: F.nll_loss(F.log_softmax(x, 1), t, w)),
    ("nll ignore", lambda x, t, w: F.nll_loss(F.log_softmax(x, 1), t, w, ignore_index=1)),
    ("cross_entropy weight smoothing", lambda x, t, w: F.cross_entropy(
        x, t, w, label_smoothing=0.1)),
    ("cross_entropy none", lambda x, t, w: F.cross_entropy(x, t, reduction="none")),
    ("multi_margin", lambda x, t, w: F.multi_margin_loss(x, t, weight=w)),
    ("cosine_embedding", lambda x, t, w: F.cosine_embedding_loss(x, x.flip(1), t * 2 - 1)),
]


@pytest.mark.parametrize("n", [5, 8, 2])
@pytest.mark.parametrize("name,fn", CLASS, ids=[c[0] for c in CLASS])
def test_class_losses(name: str, fn, n: int) -> None:
    x = rand(n, 4)
    t = _target(n, 4 if "cosine" not in name else 2)
    w = rand(4, seed=5).abs() + 0.1
    for px, pt in ((S0, S0), (S0, R), (S1, S0)):
        check(fn, [(x, pm(M4, px)), (t, pm(M4, pt)), (w, pm(M4, R))], exact_whole=False,
              grad=1)


def test_nll_over_extra_dims() -> None:
    x, t = rand(3, 4, 5), torch.randint(0, 4, (3, 5))
    check(lambda a, b: F.nll_loss(a, b), [(x, pm(M4, Sharded(2))), (t, pm(M4, S1))],
          exact_whole=False)
