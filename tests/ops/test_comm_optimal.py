"""Communication-optimal propagation: a relayout is done once per value and reused,
Partial values resolve by cost, reshapes keep split/merged dims sharded, and
CommCounter counts backward collectives and names each one's source line.
(The Megatron GPT's exact counts: tests/runtime/test_comm_gloo.py.)"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from shardwise.sharding.layout import Layout
from shardwise.tensors import cache
from tests.helpers.meshes import M4 as LINE
from tests.helpers.meshes import M24 as MESH

R = Replicated()


def on(mesh: DeviceMesh, *places: object) -> PlacementMapping:
    return PlacementMapping(mesh, list(places))


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def partial_product(grad: bool = True) -> tuple[sw.Tensor, sw.Tensor, sw.Tensor]:
    """a @ w with the contracted dim sharded over tp: Partial(sum) over tp."""
    a = sw.tensor(randn(8, 16, seed=1), sharding=on(MESH, R, Sharded(1)),
                  requires_grad=grad)
    w = sw.tensor(randn(16, 12, seed=2), sharding=on(MESH, R, Sharded(0)),
                  requires_grad=grad)
    return a @ w, a, w


def test_a_partial_read_by_three_nonlinear_ops_is_reduced_once() -> None:
    with CommCounter() as cc:
        p, a, w = partial_product()
        assert p.dist_layout.partial == (None, sw.ReduceOp.SUM)
        out = (torch.tanh(p) + torch.sigmoid(p) * torch.exp(p)).sum()
        out.backward()
    assert cc.counts == {"all_reduce": 1}, cc.table()
    assert cc.backward_counts == {}, cc.table()  # the all_reduce's gradient is the identity
    ar, wr = randn(8, 16, seed=1).requires_grad_(), randn(16, 12, seed=2).requires_grad_()
    pr = ar @ wr
    ref = (torch.tanh(pr) + torch.sigmoid(pr) * torch.exp(pr)).sum()
    ref.backward()
    assert torch.allclose(out.to_torch(), ref.detach())
    assert a.grad is not None and w.grad is not None
    assert torch.allclose(a.grad.to_torch(), ar.grad) and torch.allclose(w.grad.to_torch(), wr.grad)


def test_the_kept_result_is_one_tensor_and_one_autograd_node() -> None:
    p, _, _ = partial_product()
    target = p.dist_layout.with_partial((None, None))
    first = cache.relayout(p, target)
    assert cache.relayout(p, target) is first
    assert first.grad_fn is not None
    # a leaf that requires grad keeps nothing: its relayout belongs to one step's graph
    w = sw.tensor(randn(16, 12), sharding=on(MESH, R, Sharded(0)), requires_grad=True)
    rep = Layout.replicated(MESH, 2)
    assert cache.relayout(w, rep) is not cache.relayout(w, rep)


def test_an_in_place_write_drops_the_kept_relayout() -> None:
    x = sw.tensor(randn(8, 6), sharding=on(LINE, Sharded(0)))
    with CommCounter() as cc:
        s1 = torch.softmax(x, 0)
        s2 = torch.softmax(x, 0)
    assert cc.counts == {"all_gather": 1}, cc.table()
    assert torch.equal(s1.to_torch(), s2.to_torch())
    x.mul_(2)
    with CommCounter() as cc:
        s3 = torch.softmax(x, 0)
    assert cc.counts == {"all_gather": 1}, cc.table()
    assert torch.allclose(s3.to_torch(), torch.softmax(2 * randn(8, 6), 0))
    # a write into the kept result itself drops it too (a value held as blocks: its
    # kept relayout has buffers of its own; a whole value's moves as metadata)
    rep = Layout.replicated(LINE, 2)
    xb = sw.from_local(list((2 * randn(8, 6)).chunk(4)), on(LINE, Sharded(0)), (8, 6))
    kept = cache.relayout(xb, rep)
    kept.add_(1)
    again = cache.relayout(xb, rep)
    assert again is not kept
    assert torch.allclose(again.to_torch(), 2 * randn(8, 6))


def test_a_relayout_kept_without_grad_is_not_reused_with_grad() -> None:
    p, a, _ = partial_product()
    with torch.no_grad():
        torch.tanh(p)
    torch.tanh(p).sum().backward()
    ar, wr = randn(8, 16, seed=1).requires_grad_(), randn(16, 12, seed=2).requires_grad_()
    torch.tanh(ar @ wr).sum().backward()
    assert a.grad is not None and torch.allclose(a.grad.to_torch(), ar.grad)


def test_kept_relayouts_live_as_long_as_their_value() -> None:
    p, _, _ = partial_product()
    kept = weakref.ref(cache.relayout(p, p.dist_layout.with_partial((None, None))))
    assert kept() is not None
    del p
    gc.collect()
    assert kept() is None


def test_a_partial_whose_consumer_wants_it_sharded_is_reduce_scattered() -> None:
    a = sw.tensor(randn(8, 16, seed=1), sharding=on(LINE, Sharded(1)))
    w = sw.tensor(randn(16, 16, seed=2), sharding=on(LINE, Sharded(0)))
    y = sw.tensor(randn(8, 16, seed=3), sharding=on(LINE, Sharded(0)))
    p = a @ w
    with CommCounter() as cc:
        z = p + y  # y is Sharded(0): p is reduce_scattered to meet it
        t = torch.tanh(p)  # runs on the kept Sharded blocks: no collective
        u = torch.softmax(p, 0)  # dim 0 whole: an all_gather of the kept blocks
    assert [k for k, _, _ in cc.log] == ["reduce_scatter", "all_gather"], cc.table()
    assert t.dist_layout.dims == ((0,), ()) and u.dist_layout.dims == ((), ())
    whole = 8 * 16 * 8
    # reduce_scatter + all_gather: one all_reduce's bytes, never a second all_reduce
    assert cc.bytes["reduce_scatter"] == cc.bytes["all_gather"] == whole * 3 // 4
    ref = randn(8, 16, seed=1) @ randn(16, 16, seed=2)
    assert torch.allclose(z.to_torch(), ref + randn(8, 16, seed=3))
    assert torch.allclose(t.to_torch(), torch.tanh(ref))
    assert torch.allclose(u.to_torch(), torch.softmax(ref, 0))


@pytest.mark.parametrize("mesh", [MESH, DeviceMesh.cpu((2, 2), ("dp", "tp"))], ids=str)
def test_head_split_and_merge_keep_the_shards(mesh: DeviceMesh) -> None:
    """(B, T, D) with D over tp -> (B, H, T, D/H) heads over tp -> back: no collective."""
    v = randn(4, 6, 16)
    x = sw.tensor(v, sharding=on(mesh, Sharded(0), Sharded(2)))
    with CommCounter() as cc:
        heads = x.view(4, 6, 4, 4).transpose(1, 2)
        back = heads.transpose(1, 2).reshape(4, 6, 16)
        flat = back.flatten(0, 1)
    assert cc.total == 0, cc.table()
    assert heads.dist_layout.dims == ((0,), (1,), (), ())
    assert flat.dist_layout.dims == ((0,), (1,))
    assert torch.equal(heads.to_torch(), v.view(4, 6, 4, 4).transpose(1, 2))
    assert torch.equal(flat.to_torch(), v.flatten(0, 1))


def test_regrouped_rows_whose_blocks_stay_contiguous_move_nothing() -> None:
    v = randn(8, 6)  # 2 rows of 6 per device are 1 row of 12
    x = sw.tensor(v, sharding=on(LINE, Sharded(0)))
    with CommCounter() as cc:
        y = x.reshape(4, 12)
    assert cc.total == 0, cc.table()
    assert torch.equal(y.to_torch(), v.reshape(4, 12))


@pytest.mark.parametrize("shape,dst,places", [
    ((6, 4), (24,), (Sharded(0),)),        # 6 rows over 4: uneven major, gathered
    ((4, 12), (4, 3, 4), (Sharded(1),)),  # 3 heads over 4: uneven, gathered
    ((4, 6, 2), (4, 12), (Sharded(2),)),  # a merge with a minor dim sharded
])
def test_reshapes_that_cannot_keep_the_shards_gather(
        shape: tuple[int, ...], dst: tuple[int, ...], places: tuple[object, ...]) -> None:
    v = randn(*shape)
    x = sw.tensor(v, sharding=on(LINE, *places))
    with CommCounter() as cc:
        y = x.reshape(dst)
    assert cc.counts["all_gather"] >= 1, cc.table()
    assert torch.equal(y.to_torch(), v.reshape(dst))


def test_the_counter_names_source_lines_and_counts_backward() -> None:
    a = sw.tensor(randn(8, 16), sharding=on(MESH, Sharded(0), R), requires_grad=True)
    w = sw.tensor(randn(16, 12), sharding=on(MESH, R, Sharded(1)), requires_grad=True)
    with CommCounter() as cc:
        h = a @ w  # column parallel: a's gradient is all_reduced over tp, w's over dp
        matmul = f"{__file__.rsplit('/', 1)[-1]}:{sys._getframe().f_lineno - 1}"
        out = sw.all_gather(h).sum()
        gather = f"{matmul.rsplit(':', 1)[0]}:{sys._getframe().f_lineno - 1}"
        out.backward()
    assert {(r.where.rsplit("/", 1)[-1], r.phase, r.kind) for r in cc.by_line()} == {
        (gather, "forward", "all_gather"), (matmul, "backward", "all_reduce")}, cc.table()
    back = cc.by_line("backward")
    assert sum(r.n for r in back) == 2 and cc.backward_counts == {"all_reduce": 2}
    assert {e.step.axis_names for e in cc.events if e.phase == "backward"} == {("dp",), ("tp",)}
    assert cc.total == sum(cc.counts.values()) >= 1 and cc.log[0][0] == "all_gather"
    table = cc.table()
    assert "a @ w" in table and "sw.all_gather(h).sum()" in table and "backward" in table
    assert "; backward all_reduce: 2" in repr(cc)
    ar, wr = randn(8, 16).requires_grad_(), randn(16, 12).requires_grad_()
    (ar @ wr).sum().backward()
    assert a.grad is not None and w.grad is not None
    assert torch.allclose(a.grad.to_torch(), ar.grad) and torch.allclose(w.grad.to_torch(), wr.grad)


def test_a_backward_outside_the_counter_is_not_counted() -> None:
    a = sw.tensor(randn(8, 16), sharding=on(MESH, Sharded(0), R), requires_grad=True)
    w = sw.tensor(randn(16, 12), sharding=on(MESH, R, Sharded(1)), requires_grad=True)
    with CommCounter() as cc:
        out = F.gelu(a @ w)
    out.to_torch().sum().backward()
    assert cc.backward_total == 0 and cc.events == [e for e in cc.events
                                                     if e.phase == "forward"]


def test_item_then_backward_reduce_the_loss_once() -> None:
    p, a, _ = partial_product()
    loss = p.sum()  # Partial over tp
    with CommCounter() as cc:
        value = loss.item()
        loss.backward()
    assert cc.counts == {"all_reduce": 1}, cc.table()
    assert value == pytest.approx(float((randn(8, 16, seed=1) @ randn(16, 12, seed=2)).sum()))
    assert a.grad is not None
