"""Whole-value execution on a simulated mesh (DESIGN.md, decisions log): ops whose
operands all hold their global value run once on it with torch's autograd, so a
training step equals single-device torch bit for bit; layouts, counted collectives,
uneven and size-0 shards, Partial values and block-mode operands keep working."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from benchmarks.common import example_gpt
from shardwise import Partial, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from tests.helpers.meshes import M24 as MESH
from tests.helpers.shardcheck import whole_value

R = Replicated()


def _nodes(root: Any) -> int:
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return len(seen)


def test_gpt_megatron_steps_equal_single_device_torch() -> None:
    gpt = example_gpt()
    c = gpt.Config()
    torch.manual_seed(0)
    ref = gpt.GPT(c)
    model = gpt.megatron_by_hand(copy.deepcopy(ref), MESH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = PlacementMapping(MESH, (Sharded(0), R))
    for step in range(3):
        x, y = gpt.batch(c, 8, step)
        with CommCounter() as cc:
            loss = model(sw.tensor(x, sharding=data), sw.tensor(y, sharding=data))
        rloss = ref(x, y)
        # what the layouts imply, as in block-by-block execution
        assert dict(cc.counts) == {"all_reduce": 5}  # 2 per block over tp + the count over dp
        if step == 0:  # outside a CommCounter (whose backward hooks add identity views)
            bare = model(sw.tensor(x, sharding=data), sw.tensor(y, sharding=data))
            assert _nodes(bare.grad_fn) <= _nodes(rloss.grad_fn) + 4  # torch: 116, blocks: 640
        loss.backward()
        rloss.backward()
        # the loss is sum / count over the sharded batch (torch's mean may round apart
        # by an ulp); every gradient and parameter is torch's, bit for bit
        assert abs(loss.item() - rloss.item()) <= 1e-6 * abs(rloss.item())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad.to_torch(), q.grad), name
            assert p.grad.dist_layout == p.dist_layout, name
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is None and torch.equal(p.to_torch(), q.detach())
        assert [tuple(s.shape) for s in p.shards] == [tuple(s) for s in p.local_shapes]


def test_uneven_and_size_zero_shards_train_like_torch() -> None:
    torch.manual_seed(3)
    for hidden in (6, 3):  # tp=4: blocks 2,2,1,1 and 1,1,1,0
        ref = nn.Sequential(nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, 3))
        model = copy.deepcopy(ref)
        for mod, places in ((model[0], (Sharded(0), Sharded(0))),
                            (model[2], (Sharded(1), R))):
            for (pname, p), place in zip(list(mod.named_parameters()), places):
                setattr(mod, pname, nn.Parameter(sw.tensor(
                    p.detach(), sharding=PlacementMapping(MESH, (R, place)))))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for _ in range(2):
            x, y = torch.randn(6, 5), torch.randn(6, 3)
            xs = sw.tensor(x, sharding=PlacementMapping(MESH, (Sharded(0), R)))
            loss = ((model(xs) - y) ** 2).mean()
            rloss = F.mse_loss(ref(x), y)
            loss.backward()
            rloss.backward()
            opt.step()
            ropt.step()
            opt.zero_grad()
            ropt.zero_grad()
            assert torch.allclose(loss.to_torch(), rloss, rtol=1e-6)
        w = model[0].weight
        assert [s.shape[0] for s in w.shards] == ([2, 2, 1, 1] if hidden == 6 else
                                                   [1, 1, 1, 0]) * 2
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.to_torch(), q.detach())


def test_block_built_operands_and_whole_parameters_mix() -> None:
    """An input built from separate blocks (no whole value of its own) runs once on
    its derived whole (a copy: cache.whole_of); gradients flow into the parameters'
    wholes, shown in their layout."""
    torch.manual_seed(1)
    ref = nn.Linear(4, 6)
    model = copy.deepcopy(ref)
    model.weight = nn.Parameter(sw.tensor(model.weight.detach(),
                                          sharding=PlacementMapping(MESH, (R, Sharded(0)))))
    x = torch.randn(8, 4)
    layout = PlacementMapping(MESH, (Sharded(0), R))
    blocks = sw.from_local([s.clone() for s in sw.tensor(x, sharding=layout).shards],
                           layout, shape=(8, 4))
    assert whole_value(blocks) is None
    out = model(blocks)
    assert whole_value(out) is not None and whole_value(blocks) is None  # on the derived whole
    out.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(model.weight.grad.to_torch(), ref.weight.grad)
    assert model.weight.grad.dist_layout == model.weight.dist_layout


def test_partial_whole_values_show_a_canonical_decomposition() -> None:
    x = torch.randn(4, 8)
    w = torch.randn(8, 3)
    xs = sw.tensor(x, sharding=PlacementMapping(MESH, (R, Sharded(1))))
    ws = sw.tensor(w, sharding=PlacementMapping(MESH, (R, Sharded(0))))
    with CommCounter() as cc:
        p = xs @ ws  # contraction sharded on tp: Partial(sum), no communication
    assert p.placements == (R, Partial()) and not cc.counts
    assert torch.equal(p.to_torch(), x @ w)  # torch's own arithmetic on the whole
    for k, s in enumerate(p.shards):  # tp coordinate 0 holds the value, the rest zeros
        assert torch.equal(s, x @ w if k % 4 == 0 else torch.zeros(4, 3))
    with CommCounter() as cc:
        r = sw.all_reduce(p)
    assert dict(cc.counts) == {"all_reduce": 1} and torch.equal(r.to_torch(), x @ w)
    m = sw.tensor(x, sharding=PlacementMapping(MESH, (R, Sharded(1)))).amax(1)
    assert m.placements == (R, Partial("max"))
    assert all(torch.equal(s, x.amax(1)) for s in m.shards)


def test_leaf_flags_stay_on_the_leaf() -> None:
    mine = torch.randn(4, 4)
    t = sw.tensor(mine, sharding=PlacementMapping(MESH, (R, Sharded(0))))
    t.requires_grad_()
    assert t.requires_grad and t.is_leaf and t.grad_fn is None
    assert not mine.requires_grad
    assert all(s.requires_grad and not s.is_leaf for s in t.shards)  # views of the leaf
    (t * t).sum().backward()
    assert torch.equal(t.grad.to_torch(), 2 * mine)
    d = t.detach()
    assert not d.requires_grad and d.is_leaf
    t.grad = None
    assert t.grad is None
