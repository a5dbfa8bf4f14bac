"""A small GPT in ordinary PyTorch (nn.Linear, nn.Embedding, nn.LayerNorm, F.sdpa).

Nothing in the model knows about shardwise: tensor, sequence, context and fully
sharded data parallelism are applied from outside (``shardwise.parallel``). Tests and
benchmarks import the model from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    """Model size: vocabulary, context length, width, heads, blocks."""

    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 2


class Attention(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.heads = c.heads
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.dim, bias=False)
        self.wv = nn.Linear(c.dim, c.dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, 4 * c.dim)
        self.w2 = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.dim)
        self.attn = Attention(c)
        self.ln2 = nn.LayerNorm(c.dim)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    #: the block class each layer is (a variant model swaps it: examples/moe_gpt.py)
    block: type[nn.Module] = Block

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.layers = nn.ModuleList(self.block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """The mean next-token cross-entropy of ``idx`` (B, T) against ``targets``;
        ``positions`` (T,): each token's position (default ``0..T-1``)."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def batch(c: Config, size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of token ids and their next-token targets."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, c.vocab, (size, c.seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# ---------------------------------------------------------------------------
# Training: TP x FSDP on shardwise, checked against single-device torch.
# ---------------------------------------------------------------------------

def tp_plan() -> dict[str, Any]:
    """Megatron tensor parallelism for :class:`GPT` (the head with loss parallel)."""
    from shardwise import Sharded
    from shardwise.parallel import ColwiseParallel, RowwiseParallel

    return {"layers.*.attn.w[qkv]": ColwiseParallel(), "layers.*.attn.wo": RowwiseParallel(),
            "layers.*.mlp.w1": ColwiseParallel(), "layers.*.mlp.w2": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Sharded(-1))}


def megatron_by_hand(model: nn.Module, mesh: Any) -> nn.Module:
    """Megatron TP without a plan, over mesh axis 1 (``tp``): wq/wk/wv/w1 weight and bias
    Sharded(0), wo/w2 weight Sharded(1), every other parameter Replicated (what the
    plan of :func:`tp_plan` does, minus the head and the boundary hooks)."""
    import shardwise as sw
    from shardwise import PlacementMapping, Replicated, Sharded

    for name, mod in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        for pname, p in list(mod.named_parameters(recurse=False)):
            place: Any = Replicated()
            if last in ("wq", "wk", "wv", "w1"):
                place = Sharded(0)
            elif last in ("wo", "w2") and pname == "weight":
                place = Sharded(1)
            layout = PlacementMapping(mesh, (Replicated(), place))
            setattr(mod, pname, nn.Parameter(sw.tensor(p.detach(), sharding=layout)))
    return model


def parallelize(model: GPT, mesh: Any, *, tp: bool = True, fsdp: bool = True) -> GPT:
    """Apply the TP plan over mesh axis ``tp`` and FSDP over ``dp`` (per block, then root)."""
    from shardwise.parallel import fully_shard, parallelize_module

    if tp:
        parallelize_module(model, mesh, tp_plan(), axis="tp")
    if fsdp:
        for layer in model.layers:
            fully_shard(layer, mesh, axis="dp")
        fully_shard(model, mesh, axis="dp")
    return model


def parity(rows: list[tuple[int, float, float]], rtol: float,
           say: Any = None) -> bool:
    """Print the first and last (step, shardwise loss, torch loss) rows and the verdict;
    True when every step's relative difference is within ``rtol``.

    >>> parity([(0, 1.0, 1.0), (1, 0.5, 0.5)], 1e-4, say=print)
     step  shardwise      torch  rel. diff
        0   1.000000   1.000000   0.00e+00
        1   0.500000   0.500000   0.00e+00
    parity OK
    True
    """
    say = say or _say
    diffs = [abs(got - want) / max(abs(want), 1e-12) for _, got, want in rows]
    say(f"{'step':>5} {'shardwise':>10} {'torch':>10} {'rel. diff':>10}")
    shown = list(zip(rows, diffs, strict=True))
    for (step, got, want), diff in shown[:1] + shown[1:][-1:]:
        say(f"{step:5d} {got:10.6f} {want:10.6f} {diff:10.2e}")
    worst = max(diffs, default=0.0)
    ok = worst <= rtol
    say("parity OK" if ok else f"parity FAILED: worst relative difference {worst:.2e}")
    return ok


def device_flags(p: Any) -> None:
    """``--device`` and ``--devices-per-gpu``: where the mesh and the reference live."""
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: the mesh's "
                   "devices (sw.init_device_mesh) and the single-device reference's")
    p.add_argument("--devices-per-gpu", type=int, default=None, metavar="K",
                   help="in one process: K virtual devices on each GPU (e.g. the whole "
                        "2x2 mesh on one GPU with 4); default one device per GPU")


def reference_device(device: str) -> torch.device:
    """Where the single-device reference runs: the CPU, or this process's GPU (under
    torchrun ``LOCAL_RANK``'s, else GPU 0, where a simulated mesh's device 0 lives).

    >>> reference_device("cpu")
    device(type='cpu')
    """
    import os

    if device == "cpu":
        return torch.device("cpu")
    return torch.device(device, int(os.environ.get("LOCAL_RANK", "0")))


def _say(*args: object) -> None:
    from shardwise.distributed import process_index

    if process_index() == 0:
        print(*args, flush=True)


def _progress(total: int) -> Any:
    """``advance(loss)`` drawing a progress bar on process 0 (rich if installed)."""
    from shardwise.distributed import process_index

    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None, lambda loss: None
    if process_index() != 0:
        return None, lambda loss: None
    bar = Progress(TextColumn("training"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("loss {task.fields[loss]:.5f}"), TimeElapsedColumn())
    task = bar.add_task("train", total=total, loss=float("nan"))
    return bar, lambda loss: bar.update(task, advance=1, loss=loss)


def main(argv: list[str] | None = None) -> int:
    """Train the GPT with TP x FSDP (x CP with ``--cp``); exit 1 if a loss differs from
    single-device torch."""
    import argparse
    import contextlib
    import copy
    import time

    import shardwise as sw
    from shardwise import PlacementMapping, Replicated, Sharded
    from shardwise.debug import CommCounter
    from shardwise.distributed import maybe_initialize, process_count, shutdown
    from shardwise.parallel import context_parallel, loss_parallel

    p = argparse.ArgumentParser(description="Train a small GPT with TP x FSDP on shardwise.")
    p.add_argument("--steps", type=int, default=20, help="train up to this step")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--mesh", default=None, help="dp x tp, e.g. 2x4 (default: 2x4 simulated, "
                                                 "2 x world/2 under torchrun), or dp x cp x "
                                                 "tp, e.g. 2x2x2")
    p.add_argument("--cp", type=int, default=None, metavar="K",
                   help="context parallel over a cp axis of K devices (sequence sharded; "
                        "default mesh 2xKx2 simulated, world/(2K) x K x 2 under torchrun)")
    p.add_argument("--cp-method", default="ring", choices=("ring", "alltoall"))
    p.add_argument("--save", metavar="DIR", help="save model + optimizer + step at the end")
    p.add_argument("--resume", metavar="DIR", help="resume from a --save (any mesh)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None,
                   choices=("inductor", "aot_eager"),
                   help="torch.compile the model (inductor by default): one graph per "
                        "step's forward and backward, collectives inside")
    device_flags(p)
    args = p.parse_args(argv)
    multi = maybe_initialize(backend="gloo" if args.device == "cpu" else "nccl")
    sizes = [int(v) for v in args.mesh.split("x")] if args.mesh else []
    cp = args.cp or (sizes[1] if len(sizes) == 3 else 1)
    if len(sizes) == 2:
        dp, tp = sizes
    elif sizes:
        dp, _, tp = sizes
    else:
        world = process_count() if multi else 8
        dp, tp = (2, world // 2) if cp == 1 else (world // (2 * cp), 2)
        if not multi and cp == 1:
            tp = 4
    shape, names = ((dp, tp), ("dp", "tp")) if cp == 1 else ((dp, cp, tp), ("dp", "cp", "tp"))
    mesh = sw.init_device_mesh(args.device, shape, names,
                               devices_per_gpu=None if multi else args.devices_per_gpu)
    # context parallel: the sequence Sharded over cp, held in head-tail order (cp.shard)
    region = context_parallel(mesh, "cp", method=args.cp_method) if cp > 1 else None
    cfg = Config(dim=args.dim, layers=args.layers)
    torch.manual_seed(0)
    dev = reference_device(args.device)
    reference = GPT(cfg).to(dev)   # initialized on the CPU, so every device starts alike
    model = parallelize(copy.deepcopy(reference), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    where = f"torch.distributed, {process_count()} processes" if multi else "simulated"
    if args.device != "cpu" and not multi:
        where += f" on {args.device}"
    _say(f"GPT {cfg} on {mesh!r} ({where})")
    _say(f"  {'parameter':26} {'global':>9} {'per device':>10}  dims (S: split over axes)")
    for name in ("layers.0.attn.wq.weight", "layers.0.attn.wo.weight", "layers.0.mlp.w1.bias",
                 "tok.weight"):
        param = model.get_parameter(name)
        dims = str(param.dist_layout)[len(repr(mesh)):]
        _say(f"  {name:26} {tuple(param.shape)!s:>9} {param.local_shapes[0]!s:>10}"
             f"  {dims}")
    data = PlacementMapping(mesh, (Sharded(0),) + (Replicated(),) * (mesh.ndim - 1))

    def inputs(ids: torch.Tensor, targets: torch.Tensor) -> tuple[Any, ...]:
        if region is None:
            return sw.tensor(ids, sharding=data), sw.tensor(targets, sharding=data)
        # the model's own position ids (natural order) meet the batch in its order
        return region.shard(ids, 1, data), region.shard(targets, 1, data)

    forward: Any = model
    if args.compile:
        from torch import _dynamo
        from torch._dynamo.utils import counters

        _dynamo.reset()
        counters.clear()
        # (torch's own backends: shardwise compiles a graph of its Tensors for them)
        forward = torch.compile(model, backend=args.compile, dynamic=False)

    def reference_step(step: int) -> float:
        ids, targets = (t.to(dev) for t in batch(cfg, args.batch, step))
        loss = reference(ids, targets)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        return loss.item()

    start = 0
    if args.resume:
        start = sw.checkpoint.load_train_state(args.resume, model, opt)
        for step in range(start):  # bring the single-device reference to the same step
            reference_step(step)
        _say(f"resumed from {args.resume} at step {start}")
    rows: list[tuple[int, float, float]] = []
    comm = None
    bar, advance = _progress(args.steps - start)
    if bar is not None:
        bar.start()
    first_s = 0.0
    try:
        for step in range(start, args.steps):
            ids, targets = (t.to(dev) for t in batch(cfg, args.batch, step))
            # (compiled, the collectives run inside the graphs, where no counter sees them)
            counting = contextlib.nullcontext() if args.compile else CommCounter()
            t0 = time.perf_counter()
            with counting as counter, loss_parallel(), region or contextlib.nullcontext():
                loss = forward(*inputs(ids, targets))
                loss.backward()
            opt.step()
            opt.zero_grad()
            got = loss.item()
            if step == start:  # (with the compile, when compiled)
                first_s = time.perf_counter() - t0
            rows.append((step, got, reference_step(step)))
            comm = counter
            advance(got)
    finally:
        if bar is not None:
            bar.stop()
    if args.compile:
        breaks = sum(counters["graph_break"].values())
        _say(f"compiled ({args.compile}): {counters['stats']['unique_graphs']} graphs, "
             f"{breaks} graph breaks, first step {first_s:.1f} s")
    if comm is not None:
        _say(f"collectives per step: forward {dict(comm.counts)} "
             f"({sum(comm.bytes.values()) / 1024:.1f} KiB/device), backward "
             f"{dict(comm.backward_counts)} ({sum(comm.backward_bytes.values()) / 1024:.1f} "
             "KiB/device)")
    if args.save:
        sw.checkpoint.save_train_state(args.save, model, opt, step=args.steps)
        _say(f"saved step {args.steps} to {args.save}")
    ok = parity(rows, args.rtol)
    if args.compile and breaks:
        _say(f"compile FAILED: {dict(counters['graph_break'])}")
        ok = False
    if multi:
        shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
