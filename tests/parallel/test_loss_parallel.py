"""loss_parallel: cross_entropy over class-sharded logits equals torch's, values and
gradients, without gathering the logits."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from shardwise.parallel import loss_parallel
from tests.helpers.meshes import M24 as MESH
from tests.helpers.shardcheck import whole_value


def _case(classes: int, rows: int = 6, ignored: int = -100
          ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(classes)
    logits = torch.randn(rows, classes, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, classes, (rows,), generator=g)
    target[1] = ignored
    return logits, target


@pytest.mark.parametrize("classes", [16, 10, 3])  # even, uneven, fewer than tp devices
@pytest.mark.parametrize("kwargs", [{}, {"reduction": "sum"}, {"reduction": "none"},
                                    {"label_smoothing": 0.2}, {"ignore_index": 0}],
                         ids=["mean", "sum", "none", "smoothing", "ignore0"])
def test_values_and_gradients_match_torch(classes: int, kwargs: dict[str, object]) -> None:
    logits, target = _case(classes, ignored=int(kwargs.get("ignore_index", -100)))
    x = sw.tensor(logits, sharding=PlacementMapping(MESH, [Sharded(0), Sharded(1)]))
    x.requires_grad_()
    t = sw.tensor(target, sharding=PlacementMapping(MESH, [Sharded(0), Replicated()]))
    with loss_parallel(), CommCounter() as cc:
        loss = F.cross_entropy(x, t, **kwargs)  # type: ignore[arg-type]
    assert "all_gather" not in cc.counts  # the logits stay sharded
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in, target, **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(loss.detach().to_torch(), ref.detach())
    weights = torch.arange(1.0, 7.0, dtype=torch.float64) if ref.ndim else 1.0
    (loss * weights).sum().backward()
    (ref * weights).sum().backward()
    assert x.grad.dist_layout == x.dist_layout
    torch.testing.assert_close(x.grad.to_torch(), ref_in.grad)


def test_two_row_reductions_and_no_logit_traffic() -> None:
    logits, target = _case(16, rows=8)
    x = sw.tensor(logits, sharding=PlacementMapping(MESH, [Replicated(), Sharded(1)]))
    with CommCounter() as plain:
        F.cross_entropy(x, target)
    assert plain.counts["all_gather"] >= 1  # without the context the classes are gathered
    with loss_parallel(), CommCounter() as cc:
        loss = F.cross_entropy(x, target)
    # the row max, then the sum-exp and the target logit in one message: 8 rows each
    assert dict(cc.counts) == {"all_reduce": 2}
    # 3 numbers per row (8 rows of float64), a ring all_reduce over 4 moves 2 * 3/4 of it
    assert cc.bytes["all_reduce"] == 8 * 8 * 3 * 2 * 3 // 4
    assert cc.bytes["all_reduce"] < plain.bytes["all_gather"]
    torch.testing.assert_close(loss.to_torch(), F.cross_entropy(logits, target))
    with loss_parallel(), CommCounter() as module_cc:  # the module form calls F.cross_entropy
        torch.nn.CrossEntropyLoss()(x, target)
    assert dict(module_cc.counts) == {"all_reduce": 2}


def test_other_calls_take_the_ordinary_path() -> None:
    logits, target = _case(8)
    weight = torch.rand(8, dtype=torch.float64)
    x = sw.tensor(logits, sharding=PlacementMapping(MESH, [Replicated(), Sharded(1)]))
    with loss_parallel():
        plain = F.cross_entropy(logits, target)  # plain torch: torch's own result
        with warnings.catch_warnings():  # class weights: the classes gathered by the rule
            warnings.simplefilter("error", sw.ShardwiseFallbackWarning)
            weighted = F.cross_entropy(x, target, weight=weight)
        soft = F.cross_entropy(x, torch.softmax(logits, 1))  # probabilities as targets
        y = torch.relu(x)  # every other op as usual
    assert type(plain) is torch.Tensor
    torch.testing.assert_close(plain, F.cross_entropy(logits, target))
    torch.testing.assert_close(weighted.to_torch(), F.cross_entropy(logits, target,
                                                                    weight=weight))
    torch.testing.assert_close(soft.to_torch(), F.cross_entropy(logits,
                                                                torch.softmax(logits, 1)))
    assert y.placements == x.placements


def test_a_target_out_of_range_raises_as_in_torch() -> None:
    logits, target = _case(8)
    target[2] = 8
    x = sw.tensor(logits, sharding=PlacementMapping(MESH, [Replicated(), Sharded(1)]))
    with pytest.raises(IndexError, match=r"target 8 is out of bounds for 8 classes"), \
            loss_parallel():
        F.cross_entropy(x, target)


def test_the_block_routes_only_cross_entropy_and_restores_the_registry() -> None:
    """loss_parallel() swaps the registry's F.cross_entropy handler (as DTensor installs
    its loss ops), nested blocks keep it, and leaving the outermost one, even by an
    exception, restores the registry's own."""
    from shardwise.tensors import tensor as core

    logits, target = _case(8)
    x = sw.tensor(logits, sharding=PlacementMapping(MESH, [Replicated(), Sharded(1)]))
    F.cross_entropy(x, target)  # the registry is filled
    ordinary = core.HANDLERS[F.cross_entropy]
    with pytest.raises(RuntimeError, match="leave"), loss_parallel():
        with loss_parallel():
            pass
        with CommCounter() as cc:
            F.cross_entropy(x, target)
        assert dict(cc.counts) == {"all_reduce": 2}  # still routed after the inner one
        raise RuntimeError("leave")
    assert core.HANDLERS[F.cross_entropy] is ordinary
    fresh = sw.tensor(logits, sharding=x.sharding)  # (x counted its gather already)
    with CommCounter() as plain:
        F.cross_entropy(fresh, target)
    assert plain.counts["all_gather"] >= 1


@pytest.mark.parametrize("kwargs", [{}, {"label_smoothing": 0.2},
                                    {"reduction": "none", "ignore_index": 0}],
                         ids=["mean", "smoothing", "none"])
def test_whole_values_and_blocks_count_and_compute_alike(kwargs: dict[str, object]) -> None:
    """Logits holding their whole value (``shardwise.tensor``) run torch's kernel once;
    logits built from blocks run the block computation: the same collectives (kinds,
    bytes, phases), layout, values and gradients (to rounding)."""
    logits, target = _case(10, ignored=int(kwargs.get("ignore_index", -100)))
    t = sw.tensor(target, sharding=PlacementMapping(MESH, [Sharded(0), Replicated()]))
    whole = sw.tensor(logits, sharding=PlacementMapping(MESH, [Sharded(0), Sharded(1)]))
    blocks = whole.detach().map_blocks(lambda s: s.clone().requires_grad_())
    whole.requires_grad_()
    assert whole_value(whole) is not None and whole_value(blocks) is None
    got = []
    for x in (whole, blocks):
        with loss_parallel(), CommCounter() as cc:
            out = F.cross_entropy(x, t, **kwargs)  # type: ignore[arg-type]
            out.sum().backward()
        got.append(([(e.kind, e.nbytes, e.phase) for e in cc.events], out.dist_layout,
                    out.detach().to_torch(), x.grad.to_torch()))
    (ev_a, lay_a, val_a, grad_a), (ev_b, lay_b, val_b, grad_b) = got
    assert ev_a == ev_b and lay_a == lay_b
    torch.testing.assert_close(val_a, val_b)
    torch.testing.assert_close(grad_a, grad_b)
