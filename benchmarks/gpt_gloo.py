"""GPT training step under Gloo processes: shardwise TP x FSDP beside DTensor TP + FSDP2.

Runs ``--world`` Gloo ranks (4: a 2x2 mesh dp x tp) on 127.0.0.1, builds the GPT
of ``examples/gpt.py`` twice from one seed and parallelizes it both ways with the
same plan: Megatron tensor parallelism over ``tp`` (wq/wk/wv/w1 column-wise,
wo/w2 row-wise, the head column-wise with loss parallel; embeddings and norms
replicated) and fully sharded data parallelism over ``dp`` (one unit per block,
then the root), AdamW. Both use global-shape model code: DTensor's column-wise
styles return local tensors (DTensor has no CPU sharding rule for
``scaled_dot_product_attention``) and, as torchtitan does, each attention module
is told its local head count (``heads // tp``); shardwise runs the model unchanged.

Before timing, both run ``--check`` steps from the same weights and batches and
their losses must agree (rtol 1e-4), so the timed programs compute the same thing.
Timing: one step = forward + backward + ``opt.step()`` + ``zero_grad``; barrier
before each, the max over ranks, median (and min) over ``--repeat`` interleaved
iterations (``benchmarks.common.dist_time``).

    python -m benchmarks.gpt_gloo                 # from the repo root
    python -m benchmarks.gpt_gloo --dim 256 --repeat 5
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import (
    dist_time,
    example_gpt,
    launch_flags,
    main_launched,
    ratio,
    run_launched,
)

__all__ = ["main", "parser", "run"]

def _dtensor(model: torch.nn.Module, dp: int, tp: int) -> Any:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    col = ColwiseParallel()
    plan: dict[str, Any] = {"head": ColwiseParallel(output_layouts=Shard(-1),
                                                    use_local_output=False)}
    for i in range(len(model.layers)):  # type: ignore[arg-type]
        plan.update({f"layers.{i}.attn.wq": col, f"layers.{i}.attn.wk": col,
                     f"layers.{i}.attn.wv": col, f"layers.{i}.mlp.w1": col,
                     f"layers.{i}.attn.wo": RowwiseParallel(),
                     f"layers.{i}.mlp.w2": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    for layer in model.layers:  # type: ignore[union-attr]
        layer.attn.heads //= tp  # the model change DTensor TP needs (local heads)
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    rank = mesh["dp"].get_local_rank()

    def local_batch(ids: torch.Tensor) -> torch.Tensor:
        return ids.chunk(dp)[rank]

    def loss_of(ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        with loss_parallel():
            loss = model(local_batch(ids), local_batch(tgt))
            loss.backward()
        full = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
        dist.all_reduce(full, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
        return full  # the global batch's mean, as shardwise's loss

    return loss_of


def _shardwise(model: torch.nn.Module, dp: int, tp: int) -> Any:
    import shardwise as sw
    from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
    from shardwise.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        fully_shard,
        loss_parallel,
        parallelize_module,
    )

    mesh = DeviceMesh.cpu((dp, tp), ("dp", "tp"))
    plan = {"layers.*.attn.w[qkv]": ColwiseParallel(), "layers.*.mlp.w1": ColwiseParallel(),
            "layers.*.attn.wo": RowwiseParallel(), "layers.*.mlp.w2": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Sharded(-1))}
    parallelize_module(model, mesh, plan, axis="tp")
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh, axis="dp")
    fully_shard(model, mesh, axis="dp")
    data = PlacementMapping(mesh, (Sharded(0), Replicated()))

    def loss_of(ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        with loss_parallel():
            loss = model(sw.tensor(ids, sharding=data), sw.tensor(tgt, sharding=data))
            loss.backward()
        return loss.to_torch()

    return loss_of


def rank_body(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    gpt = example_gpt()
    world = dist.get_world_size()
    tp = args.tp
    dp = world // tp
    cfg = gpt.Config(vocab=args.vocab, seq=args.seq, dim=args.dim, heads=args.heads,
                     layers=args.layers)
    torch.manual_seed(0)
    base = gpt.GPT(cfg)
    runs: dict[str, Any] = {}
    for name, build in (("shardwise", _shardwise), ("dtensor", _dtensor)):
        model = copy.deepcopy(base)
        loss_of = build(model, dp, tp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs[name] = (loss_of, opt)
    batches = [gpt.batch(cfg, args.batch, s) for s in range(args.check + 1)]
    losses: dict[str, list[float]] = {}
    for name, (loss_of, opt) in runs.items():
        seen = []
        for ids, tgt in batches[:args.check]:
            seen.append(float(loss_of(ids, tgt).item()))
            opt.step()
            opt.zero_grad()
        losses[name] = seen
    agree = all(abs(a - b) <= 1e-4 * max(abs(b), 1e-6)
                for a, b in zip(losses["shardwise"], losses["dtensor"]))
    if not agree:
        raise AssertionError(f"losses differ: shardwise {losses['shardwise']} "
                             f"vs DTensor {losses['dtensor']}")
    ids, tgt = batches[-1]

    def stepper(loss_of: Any, opt: Any) -> Any:
        def step() -> None:
            loss_of(ids, tgt)
            opt.step()
            opt.zero_grad()
        return step

    fns = {n: stepper(*r) for n, r in runs.items()}
    from shardwise.runtime.process.world import WORLD

    def unchecked() -> None:  # the same shardwise step without the agreement check
        WORLD.agreement = False
        try:
            fns["shardwise"]()
        finally:
            WORLD.agreement = True

    fns["shardwise_unchecked"] = unchecked
    t = dist_time(fns, args.repeat, args.warmup)
    rows = {n: {"ms": v["median"] * 1e3, "min_ms": v["min"] * 1e3}
            for n, v in t.items() if v is not None}
    return {
        "benchmark": "gpt_gloo",
        "case": f"GPT V={args.vocab} T={args.seq} D={args.dim} H={args.heads} "
                f"L={args.layers} batch {args.batch}, TP {tp} x FSDP {dp}, AdamW, "
                f"{world} Gloo processes",
        "meta": {"torch": torch.__version__, "world_size": world, "cpu_count": os.cpu_count(),
                 "threads_per_rank": 1, "repeat": args.repeat, "warmup": args.warmup},
        "losses": losses,
        "step": rows,
        "x_dtensor": ratio(rows["shardwise"]["ms"], rows["dtensor"]["ms"]),
        "x_dtensor_unchecked": ratio(rows["shardwise_unchecked"]["ms"], rows["dtensor"]["ms"]),
    }


def tables(res: dict[str, Any]) -> list[str]:
    s, d = res["step"]["shardwise"], res["step"]["dtensor"]
    return [f"{res['case']}",
            f"  step ms    shardwise {s['ms']:8.2f} (min {s['min_ms']:.2f})   "
            f"DTensor+FSDP2 {d['ms']:8.2f} (min {d['min_ms']:.2f})   "
            f"ratio {res['x_dtensor']:.2f}x",
            f"  without the agreement check: shardwise "
            f"{res['step']['shardwise_unchecked']['ms']:8.2f} ms, "
            f"ratio {res['x_dtensor_unchecked']:.2f}x",
            f"  losses agree over {len(res['losses']['shardwise'])} steps (rtol 1e-4)"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--check", type=int, default=3, help="steps whose losses must agree")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    launch_flags(p, world=4)
    p.add_argument("--out", default="benchmarks/results/gpt_gloo.json")
    return p


def run(**options: Any) -> dict[str, Any] | None:
    """Rank 0's result of the GPT step comparison with ``options`` (the flags)."""
    return run_launched(parser, rank_body, options)


def main(argv: list[str] | None = None) -> int:
    return main_launched(parser, run, tables, argv)


if __name__ == "__main__":
    sys.exit(main())
