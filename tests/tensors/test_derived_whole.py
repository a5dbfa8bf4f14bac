"""Every Tensor on the whole-value path (issue 22, item 2): a value held as blocks
runs its ops once on a derived whole (``cache.whole_of``): a view where its blocks
tile one buffer (a Replicated block, chunks of one tensor, the runtime's outputs),
else a copy kept while the blocks are unchanged. Checked against plain torch, with
from_local's sharing, in-place writes, views, autograd and CommCounter counts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import DeviceMesh, Partial, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from shardwise.tensors import cache
from tests.helpers.shardcheck import whole_value

MESH = DeviceMesh.cpu(4, "x")
GRID = DeviceMesh.cpu((2, 2), ("dp", "tp"))
S0 = PlacementMapping(MESH, (Sharded(0),))


def _g() -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(0))


def test_every_entry_point_runs_once_on_a_whole_bit_identical() -> None:
    g = _g()
    made = {
        "tensor": sw.tensor(g, sharding=S0),
        "shard": sw.shard(g, MESH, ["x", None]),
        "from_local views": sw.from_local(list(g.chunk(4)), S0),
        "from_local separate": sw.from_local([c.clone() for c in g.chunk(4)], S0),
    }
    made["all_gather"] = sw.all_gather(made["from_local separate"])
    made["reshard"] = sw.shard(made["from_local separate"], MESH, [None, "x"])
    assert whole_value(made["shard"]) is not None  # sw.shard keeps the whole it placed
    for name, x in made.items():
        for op in (F.gelu, lambda t: torch.add(t, t), lambda t: t * 2 + 1, torch.exp):
            out = op(x)
            assert whole_value(out) is not None, name  # one kernel over the whole
            assert torch.equal(out.to_torch(), op(g)), name  # torch's own arithmetic
            assert out.dist_layout == x.dist_layout
        w = cache.whole_of(x)
        assert w is not None and torch.equal(w, g)


def test_derived_views_alias_the_blocks_and_copies_are_dropped_after_a_write() -> None:
    g = _g()
    views = sw.from_local(list(g.chunk(4)), S0)
    assert cache.whole_of(views).data_ptr() == g.data_ptr()  # no copy
    mine = [c.clone() for c in g.chunk(4)]
    x = sw.from_local(mine, S0)
    assert torch.equal(F.gelu(x).to_torch(), F.gelu(g))
    mine[2].add_(1.0)  # the user's block, written after from_local: the value follows
    g2 = g.clone()
    g2[4:6] += 1.0
    assert torch.equal(F.gelu(x).to_torch(), F.gelu(g2))
    assert torch.equal((x + 1).to_torch(), g2 + 1)
    x.mul_(2.0)  # an in-place op on the Tensor writes the user's blocks
    assert torch.equal(mine[2], (g2[4:6]) * 2)
    assert torch.equal((x - 1).to_torch(), g2 * 2 - 1)


def test_views_of_a_copied_value_still_alias_its_blocks() -> None:
    g = _g()
    mine = [c.clone() for c in g.chunk(4)]
    x = sw.from_local(mine, S0)
    _ = x + 1  # the copy exists
    for view in (x[2:6], x.t(), x.reshape(4, 16), x.view(64)):
        w = whole_value(view)
        assert w is None or w.data_ptr() != cache.whole_of(x).data_ptr()
    v = x.view(64)
    assert torch.equal(v.to_torch(), g.view(64))
    v.add_(1.0)  # a write through the view reaches the user's blocks, as in torch
    assert torch.equal(mine[0], g[:2] + 1)


def test_gradients_reach_the_users_blocks_once() -> None:
    g = _g()
    # Sharded on dp, replicated on tp: each block is shared by two devices
    layout = PlacementMapping(GRID, (Sharded(0), Replicated()))
    mine = [c.clone().requires_grad_() for c in g.chunk(2)]
    x = sw.from_local([mine[0], mine[0], mine[1], mine[1]], layout)
    out = (F.gelu(x) * x).sum()
    assert out.requires_grad
    out.backward()
    ref = g.clone().requires_grad_()
    (F.gelu(ref) * ref).sum().backward()
    torch.testing.assert_close(torch.cat([m.grad for m in mine]), ref.grad)
    # a leaf from from_local(requires_grad=True): its blocks are the leaves
    y = sw.from_local(list(g.chunk(4)), S0, requires_grad=True)
    (y * y).sum().backward()
    torch.testing.assert_close(y.grad.to_torch(), 2 * g)
    torch.testing.assert_close(torch.cat([s.grad for s in y.shards]), 2 * g)


def test_gradients_through_a_derived_copy_of_non_leaf_blocks() -> None:
    """Blocks that record gradients (results of ops: no leaves) derive a copy made by
    differentiable torch ops: every distinct block gets its gradient once, replicas
    included, also through chunk views of one base."""
    g = _g()
    for views in (True, False):
        base = g.clone().requires_grad_()
        parts = list(base.chunk(2)) if views else [c * 1.0 for c in base.chunk(2)]
        layout = PlacementMapping(GRID, (Sharded(0), Replicated()))
        x = sw.from_local([parts[0], parts[0], parts[1], parts[1]], layout)
        w = cache.whole_of(x)
        assert w is not None and w.grad_fn is not None  # a copy autograd records
        out = (F.gelu(x) * x).sum()
        grads = torch.autograd.grad(out, [base, *parts])
        ref = g.clone().requires_grad_()
        want = torch.autograd.grad((F.gelu(ref) * ref).sum(), ref)[0]
        torch.testing.assert_close(grads[0], want)
        torch.testing.assert_close(torch.cat(grads[1:]), want)
        with torch.no_grad():  # another autograd mode: derived afresh (a view, no graph)
            assert cache.whole_of(x) is not w


def test_counts_match_the_block_path() -> None:
    """CommCounter counts what a block-by-block run moves, whichever path runs (a
    derived copy is not used while counting; a derived view is)."""
    g = _g()
    counts = []
    for x in (sw.tensor(g, sharding=S0), sw.from_local([c.clone() for c in g.chunk(4)], S0),
              sw.from_local(list(g.chunk(4)), S0)):  # own whole, blocks, a derived view
        with CommCounter() as cc:
            out = (x @ x).sum(0)  # the right operand is gathered: an all_gather
        torch.testing.assert_close(out.to_torch(), (g @ g).sum(0))
        counts.append(dict(cc.counts))
    assert counts[0] == counts[1] == counts[2] and counts[0]


def test_partial_values_stay_on_their_blocks() -> None:
    g = _g()
    layout = PlacementMapping(MESH, (Partial(),))
    x = sw.from_local([g / 4] * 4, layout, shape=(8, 8))
    assert cache.whole_of(x) is None
    torch.testing.assert_close((x * 2).to_torch(), g * 2)
