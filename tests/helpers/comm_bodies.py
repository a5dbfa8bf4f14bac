"""Communication of the hand-sharded Megatron GPT (examples/gpt.py), shared by both
runtimes: ``n`` devices as a simulated ``(2, n // 2)`` mesh or ``n`` Gloo processes.

Megatron sharding by hand (no plan): wq/wk/wv/w1 (and w1's bias) Sharded(0) over tp,
wo/w2 weights Sharded(1), everything else Replicated; the data Sharded(0) over dp.
Megatron's block moves two all_reduces of the activations (B/dp, T, D) over tp in
the forward and two of their gradients in the backward; data parallelism adds one
all_reduce over dp of each parameter's local gradient. The expected numbers below
are computed from the shapes alone.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import torch
import torch.nn as nn

import shardwise as sw
from examples.gpt import GPT, Block, Config, batch, megatron_by_hand
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from tests.helpers.meshes import grid

R = Replicated()



def ring_all_reduce(nbytes: int, group: int) -> int:
    """Bytes each device sends in a ring all_reduce of ``nbytes`` over ``group``."""
    return int(2 * nbytes * (group - 1) / group)


def by_axes(cc: CommCounter, phase: str) -> Counter[tuple[str, tuple[str, ...]]]:
    """(kind, mesh axes) -> count, for one phase."""
    return Counter((e.kind, e.step.axis_names) for e in cc.events if e.phase == phase)


def bytes_by_axes(cc: CommCounter, phase: str) -> Counter[tuple[str, tuple[str, ...]]]:
    out: Counter[tuple[str, tuple[str, ...]]] = Counter()
    for e in cc.events:
        if e.phase == phase:
            out[(e.kind, e.step.axis_names)] += e.nbytes
    return out


def dp_gradient_bytes(model: nn.Module, mesh: DeviceMesh) -> int:
    """One all_reduce over dp of each parameter's local (tp) block."""
    dp = mesh.mesh_shape[0]
    total = 0
    for p in model.parameters():
        shape = list(p.shape)
        for d, pl in enumerate(p.placements):
            if isinstance(pl, Sharded):
                shape[pl.axis] //= mesh.mesh_shape[d]
        total += ring_all_reduce(math.prod(shape) * p.dtype.itemsize, dp)
    return total


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def check_block(n: int) -> None:
    """One Megatron block, forward and backward: exactly 2 + 2 all_reduces over tp of
    the activations' size, the dp gradient all_reduces, nothing else; values and
    gradients equal single-device torch."""
    mesh = grid(n)
    dp, tp = mesh.mesh_shape
    c = Config()
    torch.manual_seed(0)
    ref = Block(c)
    block = megatron_by_hand(copy.deepcopy(ref), mesh)
    b = 4 * dp
    x = torch.randn(b, c.seq, c.dim, generator=torch.Generator().manual_seed(1))
    g = torch.randn(b, c.seq, c.dim, generator=torch.Generator().manual_seed(2))
    data = PlacementMapping(mesh, [Sharded(0), R])
    xs = sw.tensor(x, sharding=data, requires_grad=True)
    with CommCounter() as cc:
        y = sw.all_reduce(block(xs))  # the block leaves its output Partial over tp
        y.backward(sw.tensor(g, sharding=data))
    xr = x.clone().requires_grad_(True)
    yr = ref(xr)
    yr.backward(g)
    assert close(y.to_torch(), yr.detach())
    assert xs.grad is not None and xr.grad is not None and close(xs.grad.to_torch(), xr.grad)
    for (name, p), q in zip(block.named_parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None and close(p.grad.to_torch(), q.grad), name
    act = b // dp * c.seq * c.dim * 4
    assert by_axes(cc, "forward") == {("all_reduce", ("tp",)): 2}, cc.table()
    assert bytes_by_axes(cc, "forward") == {("all_reduce", ("tp",)): 2 * ring_all_reduce(act, tp)}
    back = by_axes(cc, "backward")
    nparams = len(list(block.parameters()))
    assert back == {("all_reduce", ("tp",)): 2, ("all_reduce", ("dp",)): nparams}, cc.table()
    assert bytes_by_axes(cc, "backward") == {
        ("all_reduce", ("tp",)): 2 * ring_all_reduce(act, tp),
        ("all_reduce", ("dp",)): dp_gradient_bytes(block, mesh)}, cc.table()


def check_gpt(n: int, steps: int = 2) -> None:
    """The 2-block GPT: per step the forward moves 2 all_reduces of the activations per
    block over tp (and the loss's token count, one scalar over dp), the backward 2 per
    block plus the dp gradient all_reduces; no all_gather anywhere. Losses and
    gradients equal single-device torch (AdamW steps in between)."""
    mesh = grid(n)
    dp, tp = mesh.mesh_shape
    c = Config()
    torch.manual_seed(0)
    ref = GPT(c)
    model = megatron_by_hand(copy.deepcopy(ref), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    b = 4 * dp
    data = PlacementMapping(mesh, [Sharded(0), R])
    act = b // dp * c.seq * c.dim * 4
    for step in range(steps):
        x, y = batch(c, b, step)
        with CommCounter() as fwd:
            loss = model(sw.tensor(x, sharding=data), sw.tensor(y, sharding=data))
        with CommCounter() as cc:
            loss.backward()
        rl = ref(x, y)
        rl.backward()
        assert close(loss.to_torch(), rl.detach()), (loss.item(), rl.item())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert close(p.grad.to_torch(), q.grad), name
        assert by_axes(fwd, "forward") == {("all_reduce", ("tp",)): 2 * c.layers,
                                           ("all_reduce", ("dp",)): 1}, fwd.table()
        assert bytes_by_axes(fwd, "forward") == {
            ("all_reduce", ("tp",)): 2 * c.layers * ring_all_reduce(act, tp),
            ("all_reduce", ("dp",)): ring_all_reduce(4, dp)}, fwd.table()
        # backward() reduces the Partial loss (a scalar over dp), then the gradient runs
        assert by_axes(cc, "forward") == {("all_reduce", ("dp",)): 1}, cc.table()
        back = bytes_by_axes(cc, "backward")
        assert by_axes(cc, "backward")[("all_reduce", ("tp",))] == 2 * c.layers, cc.table()
        assert back[("all_reduce", ("tp",))] == 2 * c.layers * ring_all_reduce(act, tp)
        # T == seq: the position embedding's output gradient is its weight's size
        assert back[("all_reduce", ("dp",))] == dp_gradient_bytes(model, mesh), cc.table()
        assert set(back) == {("all_reduce", ("tp",)), ("all_reduce", ("dp",))}, cc.table()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()


def body_megatron_block_comm(n: int) -> None:
    check_block(n)


def body_megatron_gpt_comm(n: int) -> None:
    check_gpt(n)


BODIES = ["body_megatron_block_comm", "body_megatron_gpt_comm"]
