"""The operand cache's rules (shardwise.tensors.cache): one key (target layout, diverge
axes, grad mode) per kind (blocks, wholes), one staleness rule, one leaf rule, the
source's lifetime, nothing in a Tensor's ``__dict__``; and the one FSDP gradient-owner
record (runtime.owner.GradOwner) read by the counters."""

from __future__ import annotations

import gc
import weakref

import torch

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from shardwise.runtime.owner import GradOwner
from shardwise.sharding.layout import Layout
from shardwise.tensors import cache
from shardwise.tensors.tensor import Tensor, place
from tests.helpers.shardcheck import whole_value

R = Replicated()
MESH = DeviceMesh.cpu((2, 2), ("dp", "tp"))
TP = 1


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def held_as_blocks(value: torch.Tensor, *places: object) -> Tensor:
    """A Tensor held as per-device blocks (no whole), as the multi-process runtime's."""
    t = sw.tensor(value, sharding=PlacementMapping(MESH, list(places)))
    return Tensor(t.shards, t.dist_layout, t.shape)


def activation(*places: object, seed: int = 0) -> Tensor:
    """A non-leaf that requires grad, held as blocks (``leaf * 1``)."""
    leaf = held_as_blocks(randn(4, 8, seed=seed), *places).requires_grad_()
    return leaf * 1


def gathered() -> Layout:
    return Layout.replicated(MESH, 2)


def test_blocks_are_kept_per_target_diverge_and_grad_mode() -> None:
    x = activation(R, Sharded(1))
    rep = gathered()
    first = cache.blocks(x, rep, (TP,))
    assert cache.blocks(x, rep, (TP,)) is first
    assert cache.blocks(x, rep, (0, TP)) is not first  # the diverge axes are in the key
    assert cache.blocks(x, rep) is cache.relayout(x, rep).shards  # no diverge: its blocks
    with torch.no_grad():  # grad mode is in the key: kept apart, both stay
        off = cache.relayout(x, rep)
        assert cache.relayout(x, rep) is off
    assert cache.relayout(x, rep) is not off
    assert cache.blocks(x, rep, (TP,)) is first
    assert cache.kept_layouts([x], False) == ((rep,),)
    assert cache.kept_layouts([x], True) == ()  # held as blocks: no whole kept


def test_two_ops_reading_one_value_share_one_diverge() -> None:
    w = held_as_blocks(randn(8, 6, seed=1), R, Sharded(1))
    for source, all_reduces in (("activation", 1), ("leaf", 2)):
        leaf = held_as_blocks(randn(4, 8), R, R).requires_grad_()
        x = leaf * 1 if source == "activation" else leaf
        with CommCounter() as cc:
            y = x @ w + x @ w  # x replicated over tp, each output split over tp
            y.sum().backward()
        # the leaf rule: a leaf keeps nothing, each use diverges (and all_reduces) alone
        assert cc.backward_counts.get("all_reduce", 0) == all_reduces, cc.table()
        assert leaf.grad is not None
        ref = torch.ones(4, 6, dtype=torch.float64) @ (2 * randn(8, 6, seed=1)).T
        assert torch.allclose(leaf.grad.to_torch(), ref)


def test_the_leaf_rule_keeps_nothing_for_blocks_and_wholes() -> None:
    rep = gathered()
    p = held_as_blocks(randn(4, 8), R, Sharded(1)).requires_grad_()
    assert cache.relayout(p, rep) is not cache.relayout(p, rep)
    assert cache.blocks(p, rep, (TP,)) is not cache.blocks(p, rep, (TP,))
    w = sw.tensor(randn(4, 8), sharding=PlacementMapping(MESH, [R, Sharded(1)]))
    w.requires_grad_()  # a parameter held whole
    assert whole_value(w) is not None and w.is_leaf
    with CommCounter() as cc:
        cache.whole(w, rep)
        cache.whole(w, rep)
    assert cc.counts == {"all_gather": 2}, cc.table()  # counted at each use
    assert p._cache is None and w._cache is None


def test_a_whole_counts_its_layout_change_once_until_written() -> None:
    x = sw.tensor(randn(4, 8), sharding=PlacementMapping(MESH, [R, Sharded(1)]))
    rep = gathered()
    with CommCounter() as cc:
        a = cache.whole(x, rep)
        assert cache.whole(x, rep) is a
    assert cc.counts == {"all_gather": 1}, cc.table()
    assert cache.kept_layouts([x], True) == ((rep,),)
    assert cache.kept_layouts([x], False) == ()  # the blocks kind is kept apart
    x.mul_(2)  # the staleness rule: the source's version moved
    assert cache.kept_layouts([x], True) == ()
    with CommCounter() as cc:
        assert torch.equal(cache.whole(x, rep), 2 * randn(4, 8))
    assert cc.counts == {"all_gather": 1}, cc.table()


def test_a_write_to_the_source_or_the_kept_blocks_drops_the_entry() -> None:
    x = activation(R, R)
    rep, axes = gathered(), (TP,)
    kept = cache.blocks(x, rep, axes)
    with torch.no_grad():
        x.mul_(2)
    again = cache.blocks(x, rep, axes)
    assert again is not kept
    with torch.no_grad():
        again[0].add_(1)  # the kept result itself (shared by the replicas)
    assert cache.blocks(x, rep, axes) is not again
    assert cache.kept_layouts([x], False) == ()  # x's own layout: nothing to keep


def test_new_shards_make_every_entry_stale() -> None:
    x = held_as_blocks(randn(4, 8), R, Sharded(1))
    rep = gathered()
    kept = cache.relayout(x, rep)
    x.data = held_as_blocks(randn(4, 8, seed=3), R, Sharded(1))
    assert cache.kept_layouts([x], False) == ()
    fresh = cache.relayout(x, rep)
    assert fresh is not kept and torch.equal(fresh.to_torch(), randn(4, 8, seed=3))


def test_kept_operands_live_as_long_as_their_source() -> None:
    x = activation(R, Sharded(1))
    rep = gathered()
    kept = weakref.ref(cache.relayout(x, rep))
    blocks = weakref.ref(cache.blocks(x, rep, (TP,))[0])
    w = sw.tensor(randn(4, 8), sharding=PlacementMapping(MESH, [R, Sharded(1)]))
    w = w.requires_grad_() * 1
    assert whole_value(w) is not None
    with CommCounter():
        view = weakref.ref(cache.whole(w, rep, (0,)))
    assert kept() is not None and blocks() is not None and view() is not None
    del x, w
    gc.collect()
    assert kept() is None and blocks() is None and view() is None


def test_ops_keep_nothing_in_a_tensors_dict() -> None:
    p = place(randn(4, 8), Layout(MESH, ((), (TP,)), (sw.ReduceOp.SUM, None)))
    x = activation(R, Sharded(1))
    y = (torch.tanh(p) + torch.exp(p)) @ randn(8, 2) + x @ randn(8, 2)
    y.sum().backward()
    assert y.sum().item() == y.sum().item()
    for t in (p, x, y):
        assert not [k for k in t.__dict__ if k.startswith("_")], t.__dict__
    assert p._cache is not None  # the Partial was reduced once, kept in the slot


def test_the_grad_owner_leaves_its_axes_out_of_the_counted_all_reduce() -> None:
    w = held_as_blocks(randn(8, 6, seed=1), R, Sharded(1))

    def backward_all_reduces(owner: GradOwner | None) -> list[tuple[int, ...]]:
        x = activation(R, R)
        x._grad_owner = owner
        with CommCounter() as cc:
            (x @ w).sum().backward()
        return [e.step.axes for e in cc.events
                if e.kind == "all_reduce" and e.phase == "backward"]

    assert backward_all_reduces(None) == [(TP,)]
    assert backward_all_reduces(GradOwner((TP,))) == []
    assert backward_all_reduces(GradOwner((0,))) == [(TP,)]
