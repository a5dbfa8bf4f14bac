"""Context-parallel test bodies shared by both runtimes: each takes the world size ``n``.

Run directly they use simulated meshes; run on every rank of an ``n``-process Gloo group
(``harness.py``) the same code builds meshes over the processes. Each body checks
against single-device torch: attention forward and backward (1e-5 relative), the
collectives ``CommCounter`` sees beside their closed forms, and the GPT of
examples/gpt.py trained on cp x tp (x dp where the mesh has room).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from benchmarks.common import example_gpt
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from shardwise.parallel import context_parallel, fully_shard, loss_parallel, parallelize_module
from shardwise.parallel.context_attention import kv_repeats

RTOL = 1e-5

# (name, q heads, kv heads, length, causal, mask kind, value head size); a value head
# size other than q's (8) takes the plain-ops path, the others torch's fused kernel
CASES = [
    ("causal", 4, 4, 16, True, None, 8),
    ("causal-uneven-gqa", 4, 2, 13, True, None, 8),
    ("documents", 4, 4, 13, False, "documents", 8),
    ("float-mask", 4, 4, 16, False, "float", 8),
    ("full", 4, 1, 11, False, None, 8),
    ("causal-uneven-value-dim", 4, 2, 10, True, None, 6),
]


def close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    """Relative to the reference's largest value (1e-5 of it), elementwise."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    got, want = got.detach(), want.detach()
    err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e}"


def mask_of(kind: str | None, length: int, heads: int) -> torch.Tensor | None:
    """A packed-documents mask (causal within each document) or an additive float mask."""
    if kind == "documents":
        doc = torch.arange(length) * 3 // length            # three documents
        same = doc[:, None] == doc[None, :]
        return same & torch.ones(length, length, dtype=torch.bool).tril()
    if kind == "float":
        return torch.randn(heads, length, length, generator=torch.Generator().manual_seed(5))
    return None


def attention_case(mesh: DeviceMesh, method: str, case: tuple[Any, ...]) -> dict[str, int]:
    """One attention call on ``mesh`` (with a ``cp`` axis) against torch, forward and
    backward; returns the forward collectives' counts."""
    name, heads, kv, length, causal, kind, ev = case
    gen = torch.Generator().manual_seed(length * 10 + heads)
    q, k = (torch.randn(2, h, length, 8, generator=gen, requires_grad=True)
            for h in (heads, kv))
    v = torch.randn(2, kv, length, ev, generator=gen, requires_grad=True)
    mask = mask_of(kind, length, heads)
    gqa = kv != heads
    want = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa)
    g = torch.randn(want.shape, generator=gen)
    want.backward(g)
    cp = context_parallel(mesh, "cp", method=method)
    leaves = [cp.shard(t.detach(), 2).detach().requires_grad_() for t in (q, k, v)]
    m = None if mask is None else cp.shard(mask, (-2, -1))
    with cp, CommCounter() as cc:
        y = F.scaled_dot_product_attention(*leaves, m, is_causal=causal, enable_gqa=gqa)
    (y * cp.shard(g, 2)).sum().backward()
    what = f"{method} {name} on {mesh!r}"
    close(y.to_torch(), want.detach(), f"{what}: output")  # natural order, no unshard
    for leaf, ref, label in zip(leaves, (q, k, v), "qkv"):
        assert leaf.grad is not None and ref.grad is not None
        close(leaf.grad.to_torch(), ref.grad, f"{what}: d{label}")
    return dict(cc.counts)


def attention_matches_torch(n: int) -> None:
    """Both methods, every case, at cp = n and (where n = 4) cp = 2 beside dp = 2."""
    meshes = [DeviceMesh.cpu(n, "cp")]
    if n == 4:
        meshes.append(DeviceMesh.cpu((2, 2), ("dp", "cp")))
    for mesh in meshes:
        for method in ("ring", "alltoall"):
            for case in CASES:
                if method == "alltoall" and case[1] % mesh.axis_size("cp"):
                    continue
                attention_case(mesh, method, case)


def counts_match_formulas(n: int) -> None:
    """Ring: cp - 1 ppermutes of the KV block, no all_gather; all-to-all: 4 exchanges;
    the bytes each device sends to the others as the closed forms (ring
    2*N*h_kv*(cp-1)/cp, Ulysses 4*N*h*(cp-1)/cp^2)."""
    mesh = DeviceMesh.cpu(n, "cp")
    b, heads, kv, length, e = 2, 4, 2, 8 * n, 8
    q = torch.randn(b, heads, length, e)
    k, v = torch.randn(b, kv, length, e), torch.randn(b, kv, length, e)
    tokens, item = b * length, q.element_size()
    for method in ("ring", "alltoall"):
        cp = context_parallel(mesh, "cp", method=method)
        qs, ks, vs = (cp.shard(t, 2) for t in (q, k, v))
        with cp, CommCounter() as cc:
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        if method == "ring":
            assert dict(cc.counts) == {"ppermute": n - 1}, dict(cc.counts)
            want = 2 * tokens * kv * e * (n - 1) // n * item
            assert cc.bytes["ppermute"] == want, (cc.bytes, want)
        else:
            assert dict(cc.counts) == {"all_to_all": 4}, dict(cc.counts)
            # q and the output carry h = heads * e per token, k and v h_kv (GQA's kv
            # heads repeated the fewest times that divide by cp)
            h_kv = kv * kv_repeats(heads, kv, n)
            want = (2 * heads + 2 * h_kv) * e * tokens * (n - 1) // (n * n) * item
            assert cc.bytes["all_to_all"] == want, (cc.bytes, want)


def gpt_mesh(n: int) -> DeviceMesh:
    """dp x cp x tp = 2x2x2 simulated (n = 8), cp x tp = 2x2 on 4 processes."""
    if n == 8:
        return DeviceMesh.cpu((2, 2, 2), ("dp", "cp", "tp"))
    return DeviceMesh.cpu((2, 2), ("cp", "tp"))


def gpt_trains_like_torch(n: int, method: str = "ring", steps: int = 2) -> None:
    """examples/gpt.py's GPT on cp x tp (x dp): TP plan, FSDP over dp, the batch and
    targets through cp.shard; the position ids natural (ring: they meet the batch in
    its order) or through cp.shard (all-to-all); losses and every gradient equal
    torch's."""
    gpt = example_gpt()
    mesh = gpt_mesh(n)
    cfg = gpt.Config(seq=12, layers=1)
    torch.manual_seed(0)
    ref = gpt.GPT(cfg)
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, gpt.tp_plan(), axis="tp")
    if "dp" in mesh.axis_names:
        fully_shard(model.layers[0], mesh, axis="dp")
        fully_shard(model, mesh, axis="dp")
    cp = context_parallel(mesh, "cp", method=method)
    data = PlacementMapping(mesh, tuple(Sharded(0) if a == "dp" else Replicated()
                                        for a in mesh.axis_names))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        ids, targets = gpt.batch(cfg, 4, step)
        with cp, loss_parallel():
            positions = torch.arange(cfg.seq)
            loss = model(cp.shard(ids, 1, data), cp.shard(targets, 1, data),
                         positions if method == "ring" else cp.shard(positions, 0))
            loss.backward()
        want = ref(ids, targets)
        want.backward()
        close(loss.detach().to_torch().reshape(()), want.detach(), f"loss {step}")
        for name, p in ref.named_parameters():
            got = model.get_parameter(name).grad
            assert got is not None and p.grad is not None, name
            got = got.to_torch() if isinstance(got, sw.Tensor) else got  # unplanned: plain
            close(got, p.grad, f"step {step} grad {name}", 1e-4)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def gpt_trains_alltoall(n: int) -> None:
    gpt_trains_like_torch(n, "alltoall", steps=1)


def value_in_region_order(n: int) -> None:
    """What users see of a load-balanced region's values: natural order. cp.shard
    reorders what each device holds (head-tail) without touching its input; to_torch,
    cp.unshard and gathers give natural order back; a natural-order operand (a
    position embedding, a bool or int mask) meets a region value in its order;
    slicing, cat, cumsum along the sequence give torch's result (natural order first,
    a gather CommCounter counts); writes in place that would mix orders refuse; the
    gradients of all of it are torch's. Lengths not divisible by 2 * cp."""
    mesh = DeviceMesh.cpu(n, "cp")
    cp = context_parallel(mesh, "cp")
    t = 4 * n + 3
    gen = torch.Generator().manual_seed(7)
    x = torch.arange(2 * t, dtype=torch.float32).view(2, t)
    before = x.clone()
    held = cp.shard(x, 1)
    assert torch.equal(x, before) and held.placements == (Sharded(1),)
    assert torch.equal(held.to_torch(), x)
    mine = held.addressable_shards  # device 0 holds a head piece and a tail piece
    if mesh.devices[0] in mine:
        block = mine[mesh.devices[0]][0].tolist()
        head = (held.local_shapes[0][1] + 1) // 2
        assert block[:head] == list(range(head)) and block[head:] == list(
            range(t - held.local_shapes[0][1] + head, t)), block
    gathered = cp.unshard(held, 1)
    assert gathered.placements == (Replicated(),) and torch.equal(gathered.to_torch(), x)
    natural = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(1)]))
    assert torch.equal(cp.shard(natural, 1).to_torch(), x)
    plain = context_parallel(mesh, "cp", load_balance=False)
    assert torch.equal(plain.shard(x, 1).to_torch(), x)
    # natural-order operands meet region values in the region's order
    h = torch.randn(2, t, 3, generator=gen, requires_grad=True)
    pos = torch.randn(t, 3, generator=gen)
    hs = cp.shard(h, 1)
    close((hs + pos).to_torch(), h + pos, "plain position embedding")
    close((hs + sw.tensor(pos, sharding=PlacementMapping(mesh, [Replicated()]))).to_torch(),
          h + pos, "Replicated position embedding")
    keep = torch.rand(t, t, generator=gen) > 0.5
    ms = cp.shard(keep, (-2, -1))
    assert ms.dtype == torch.bool and torch.equal(ms.to_torch(), keep)
    tri = torch.ones(t, t, dtype=torch.bool).tril()
    assert torch.equal((ms & tri).to_torch(), keep & tri)
    ids = cp.shard(torch.arange(t).view(1, t), 1)
    assert torch.equal((ids * 2 + torch.arange(t)).to_torch(), torch.arange(t).view(1, t) * 3)
    # ops that keep the sequence whole keep the order: no communication
    with CommCounter() as cc:
        kept = (hs[..., :2] * 2).transpose(0, 1).reshape(t, 4).softmax(-1)
    assert not cc.counts and kept.dist_layout.orders, (dict(cc.counts), kept)
    close(kept.to_torch(), (h[..., :2] * 2).transpose(0, 1).reshape(t, 4).softmax(-1), "kept")
    # along the sequence: natural order first, counted
    with CommCounter() as cc:
        sliced, joined, summed = hs[:, 1:5], torch.cat([hs, hs], 1), hs.cumsum(1)
    assert cc.counts.get("all_gather", 0) >= 3, dict(cc.counts)
    close(sliced.to_torch(), h[:, 1:5], "slice")
    close(joined.to_torch(), torch.cat([h, h], 1), "cat")
    close(summed.to_torch(), h.cumsum(1), "cumsum")
    with pytest.raises(sw.ShardingError, match=r"cp\.unshard"):
        hs.detach().cumsum_(1)
    llama_block_moves_only_kv(cp, gen)
    # gradients through all of it are torch's, in natural order
    w = torch.randn(3, 4, generator=gen)
    with cp:
        y = F.softmax((hs + pos) @ w, -1).cumsum(1)[:, 2:].sum(1)
    (y * torch.arange(4.0)).sum().backward()
    got = h.grad.clone()  # type: ignore[union-attr]
    h.grad = None
    (F.softmax((h + pos) @ w, -1).cumsum(1)[:, 2:].sum(1) * torch.arange(4.0)).sum().backward()
    close(got, h.grad, "d(input)")  # type: ignore[arg-type]


def llama_block_moves_only_kv(cp: Any, gen: torch.Generator) -> None:
    """A Llama-style attention block on a region value: RoPE from natural-order cos and
    sin tables (the halves of the head dim sliced and joined), GQA's repeat_kv
    (expand + reshape), rms_norm: torch's forward and input gradient, and the ring's
    cp - 1 KV hops the only communication."""
    b, heads, kv, t, e = 2, 4, 2, 4 * cp.mesh.axis_size("cp") + 1, 8
    ws = [torch.randn(16, h * e, generator=gen) * 0.3 for h in (heads, kv, kv)]
    angles = torch.arange(t)[:, None] * torch.rand(e, generator=gen)
    cos, sin = angles.cos(), angles.sin()

    def block(x: Any) -> Any:
        q, k, v = ((x @ w).view(b, t, -1, e).transpose(1, 2) for w in ws)
        q, k = ((z * cos + torch.cat((-z[..., e // 2:], z[..., :e // 2]), -1) * sin)
                for z in (q, k))
        k, v = (z[:, :, None].expand(b, kv, heads // kv, t, e).reshape(b, heads, t, e)
                for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.rms_norm(y.transpose(1, 2).reshape(b, t, heads * e), (heads * e,))

    x = torch.randn(b, t, 16, generator=gen, requires_grad=True)
    want = block(x)
    want.sum().backward()
    dx = x.grad
    x.grad = None
    with cp, CommCounter() as cc:
        y = block(cp.shard(x, 1))
    assert dict(cc.counts) == {"ppermute": cp.mesh.axis_size("cp") - 1}, dict(cc.counts)
    y.sum().backward()
    close(y.to_torch(), want, "llama block")
    close(x.grad, dx, "llama block: d(input)")  # type: ignore[arg-type]


BODIES = ["attention_matches_torch", "counts_match_formulas", "value_in_region_order",
          "gpt_trains_like_torch", "gpt_trains_alltoall"]
