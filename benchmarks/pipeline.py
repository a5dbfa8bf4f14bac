"""Pipeline schedules on 4 Gloo processes: measured step time beside the simulator's
prediction, and beside ``torch.distributed.pipelining`` on the same model.

Each stage is a module of known cost: its forward sleeps ``--forward-ms``, its input
gradient ``--backward-ms - --weight-ms`` and its weight gradient ``--weight-ms`` (two
tiny autograd Functions, so a zero-bubble ``I`` runs only the first and ``W`` only the
second; a full ``B`` runs both). Sleeping stages keep the prediction honest on a
shared machine: ranks do not compete for the cores while they "compute". The costs
fed to ``simulate()`` are calibrated in-process (a stage's forward, input-gradient and
weight-gradient times measured alone on each rank, the median over runs, then over
ranks) and ``p2p`` is half a measured round trip of one activation between paired
ranks, every rank exchanging at once. The executor's own work (splitting
microbatches, the transport, autograd bookkeeping) and the machine's wake-up latency
are what the measured time adds; torch's step is measured against the same
prediction (``torch_x_predicted``), so the two excesses compare.

For each schedule (GPipe, 1F1B: one stage per rank; Interleaved1F1B,
InterleavedZeroBubble: two per rank, loop placement; ZBVZeroBubble: two per rank, V
placement) the shardwise step (``sched.step``) and torch's (``PipelineStage`` + the
schedule class of the same name) run interleaved (``benchmarks.common.dist_time``:
barrier, max over ranks, median and min over ``--repeat``), after a check that their
per-microbatch losses agree.

    python -m benchmarks.pipeline                  # from the repo root: 4 ranks, m = 8
    python -m benchmarks.pipeline --schedules 1F1B --repeat 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import dist_time, launch_flags, main_launched, ratio, run_launched

__all__ = ["SCHEDULES", "main", "parser", "run", "tables"]

# name -> (stages per rank, placement); shardwise's and torch's classes share the names
SCHEDULES = {"GPipe": (1, "loop"), "1F1B": (1, "loop"), "Interleaved1F1B": (2, "loop"),
             "InterleavedZeroBubble": (2, "loop"), "ZBVZeroBubble": (2, "v")}


class _InputPath(torch.autograd.Function):
    """Forward: sleep ``f`` s, return a copy of ``x``; backward: sleep ``b`` s, pass the
    gradient through (the input-gradient half)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, b: float) -> torch.Tensor:
        ctx.b = b
        time.sleep(f)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.b)
        return g, None, None


class _WeightPath(torch.autograd.Function):
    """Forward: ``w`` broadcast to ``x``'s shape (free); backward: sleep ``b`` s, the
    weight gradient (``x`` takes none: the weight-gradient half)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, x: torch.Tensor, b: float) -> torch.Tensor:
        ctx.b = b
        return w.expand_as(x).clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.b)
        return g.reshape(-1, g.shape[-1]).sum(0), None, None


class SleepStage(nn.Module):
    """A stage of known cost: forward ``f``, input gradient ``bi``, weight gradient
    ``bw`` seconds; ``y = x + w`` in value."""

    def __init__(self, width: int, f: float, bi: float, bw: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(width))
        self.f, self.bi, self.bw = f, bi, bw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_InputPath.apply(x, self.f, self.bi)
                + _WeightPath.apply(self.w, x.detach(), self.bw))


def _median_s(fn: Any, n: int = 7) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(args: argparse.Namespace) -> dict[str, float]:
    """A stage's forward, input-gradient and weight-gradient times (ms) measured alone
    in this process (medians): the costs the simulator is given."""
    st = SleepStage(args.width, args.forward_ms / 1e3, (args.backward_ms - args.weight_ms)
                    / 1e3, args.weight_ms / 1e3)
    x = torch.randn(args.rows, args.width, requires_grad=True)
    fwd = _median_s(lambda: st(x))

    def grads(inputs: list[torch.Tensor]) -> Any:
        y = st(x)
        t0 = time.perf_counter()
        torch.autograd.grad(y, inputs, torch.ones_like(y))
        return time.perf_counter() - t0

    i = statistics.median(grads([x]) for _ in range(7))
    w = statistics.median(grads([st.w]) for _ in range(7))
    return {"forward": fwd * 1e3, "input": i * 1e3, "weight": w * 1e3,
            "backward": (i + w) * 1e3}


def p2p_latency_ms(args: argparse.Namespace) -> float:
    """Half the round trip of one activation between paired ranks (0-1, 2-3, ...: every
    rank exchanging at once, as in a step), shardwise's point-to-point transfer, the
    median over ranks of each one's median; every rank returns it."""
    from shardwise.runtime.process import p2p

    me, world = dist.get_rank(), dist.get_world_size()
    peer = me ^ 1
    x = torch.randn(args.rows, args.width)
    there, back = p2p.stream_tag(90, 91), p2p.stream_tag(91, 90)
    times = []
    if peer < world:
        for i in range(21):
            t0 = time.perf_counter()
            if me % 2 == 0:
                p2p.send(x, peer, there, f"ping{i}")
                p2p.recv(peer, back, f"pong{i}")
            else:
                p2p.send(p2p.recv(peer, there, f"ping{i}"), peer, back, f"pong{i}")
            times.append(time.perf_counter() - t0)
        p2p.flush()
    mine = torch.tensor([statistics.median(times[3:]) / 2 * 1e3 if times else float("nan")],
                        dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return float(torch.cat(every).nanmedian())


def _stages(args: argparse.Namespace, n: int) -> list[SleepStage]:
    bi = (args.backward_ms - args.weight_ms) / 1e3
    return [SleepStage(args.width, args.forward_ms / 1e3, bi, args.weight_ms / 1e3)
            for _ in range(n)]


def _shardwise_step(name: str, args: argparse.Namespace, p: int) -> tuple[Any, Any]:
    from shardwise import DeviceMesh, pipelining

    v, style = SCHEDULES[name]
    pipe = pipelining.pipeline(_stages(args, p * v), DeviceMesh.cpu(p, "pp"), stages_per_rank=v,
                               style=style)
    cls = {"GPipe": pipelining.ScheduleGPipe, "1F1B": pipelining.Schedule1F1B,
           "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B,
           "InterleavedZeroBubble": pipelining.ScheduleInterleavedZeroBubble,
           "ZBVZeroBubble": pipelining.ScheduleZBVZeroBubble}[name]
    sched = cls(pipe, n_microbatches=args.microbatches, loss_fn=F.mse_loss)
    return sched, lambda x, t, losses: sched.step(x, target=t, losses=losses)


def _torch_step(name: str, args: argparse.Namespace, p: int) -> Any:
    from torch.distributed import pipelining as TP

    v, style = SCHEDULES[name]
    n = p * v
    me = dist.get_rank()
    mine = ([s for s in range(n) if s % p == me] if style == "loop" else [me, 2 * p - 1 - me])
    mods = _stages(args, n)
    stages = [TP.PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]
    cls = getattr(TP, f"Schedule{name}")
    sched = (cls(stages[0], n_microbatches=args.microbatches, loss_fn=F.mse_loss) if v == 1
             else cls(stages, n_microbatches=args.microbatches, loss_fn=F.mse_loss))
    first, last = 0 in mine, n - 1 in mine

    def step(x: torch.Tensor, t: torch.Tensor, losses: list[Any]) -> Any:
        return sched.step(*((x,) if first else ()), target=t if last else None,
                          losses=losses if last else None)
    return step


def rank_body(args: argparse.Namespace) -> dict[str, Any]:
    from shardwise.pipelining import simulate

    torch.set_num_threads(1)
    p = dist.get_world_size()
    costs = calibrate(args)
    mine = torch.tensor([costs[k] for k in ("forward", "input", "weight")],
                        dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(p)]
    dist.all_gather(every, mine)  # one cost table on every rank: the median over ranks
    t = torch.stack(every).median(dim=0).values
    costs = {"forward": float(t[0]), "input": float(t[1]), "weight": float(t[2]),
             "backward": float(t[1] + t[2])}
    lat = p2p_latency_ms(args)
    g = torch.Generator().manual_seed(0)
    rows_total = args.rows * args.microbatches
    x = torch.randn(rows_total, args.width, generator=g)
    tgt = torch.randn(rows_total, args.width, generator=g)
    out: list[dict[str, Any]] = []
    for name in args.schedules:
        sched, ours = _shardwise_step(name, args, p)
        theirs = _torch_step(name, args, p)
        ls_ours: list[Any] = []
        ls_theirs: list[Any] = []
        ours(x, tgt, ls_ours)
        theirs(x, tgt, ls_theirs)
        if ls_ours or ls_theirs:  # the last stage's rank: the same losses
            a = [float(v) for v in ls_ours]
            b = [float(v.detach()) for v in ls_theirs]
            if len(a) != len(b) or any(abs(u - w) > 1e-5 * max(abs(w), 1e-6)
                                       for u, w in zip(a, b)):
                raise AssertionError(f"{name}: losses differ: shardwise {a}, torch {b}")
        sim = simulate(sched, forward=costs["forward"], backward=costs["backward"],
                       weight=costs["weight"], p2p=lat)
        sim0 = simulate(sched, forward=costs["forward"], backward=costs["backward"],
                        weight=costs["weight"])
        timed = dist_time({"shardwise": lambda f=ours: f(x, tgt, []),  # type: ignore[misc]
                           "torch": lambda f=theirs: f(x, tgt, [])},  # type: ignore[misc]
                          args.repeat, args.warmup)
        s, th = timed["shardwise"], timed["torch"]
        assert s is not None and th is not None
        ms, tms = s["median"] * 1e3, th["median"] * 1e3
        out.append({"schedule": name, "stages": len(sched.pipe.stages),
                    "microbatches": args.microbatches,
                    "predicted_ms": sim.step_time, "predicted_no_p2p_ms": sim0.step_time,
                    "bubble": sim.bubble, "measured_ms": ms, "min_ms": s["min"] * 1e3,
                    "x_predicted": ratio(ms, sim.step_time),
                    "torch_ms": tms, "torch_min_ms": th["min"] * 1e3,
                    "torch_x_predicted": ratio(tms, sim.step_time),
                    "x_torch": ratio(ms, tms)})
    return {
        "benchmark": "pipeline",
        "case": f"{p} Gloo processes, m={args.microbatches} microbatches of {args.rows}x"
                f"{args.width}, sleeping stages F={args.forward_ms:g} B={args.backward_ms:g} "
                f"(W={args.weight_ms:g}) ms",
        "meta": {"torch": torch.__version__, "world_size": p, "cpu_count": os.cpu_count(),
                 "repeat": args.repeat, "warmup": args.warmup},
        "costs_ms": costs, "p2p_ms": lat, "rows": out,
    }


def tables(res: dict[str, Any]) -> list[str]:
    c = res["costs_ms"]
    lines = [f"pipeline schedules: {res['case']}",
             f"  calibrated: F {c['forward']:.2f} ms, I {c['input']:.2f} ms, W "
             f"{c['weight']:.2f} ms; p2p {res['p2p_ms']:.3f} ms (half a round trip)",
             f"  {'schedule':22} {'stages':>6} {'predicted':>9} {'measured':>9} {'min':>8} "
             f"{'x pred':>7} {'bubble':>7} {'torch':>9} {'min':>8} {'x pred':>7} "
             f"{'x torch':>8}"]
    for r in res["rows"]:
        lines.append(
            f"  {r['schedule']:22} {r['stages']:6d} {r['predicted_ms']:9.1f} "
            f"{r['measured_ms']:9.1f} {r['min_ms']:8.1f} {r['x_predicted']:7.3f} "
            f"{r['bubble']:7.3f} {r['torch_ms']:9.1f} {r['torch_min_ms']:8.1f} "
            f"{r['torch_x_predicted']:7.3f} {r['x_torch']:8.3f}")
    lines.append("  (ms per step: median and min over the repeats of the max over ranks; x pred "
                 "= measured / predicted, for shardwise and for torch)")
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=4, help="rows per microbatch")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--forward-ms", type=float, default=10.0)
    p.add_argument("--backward-ms", type=float, default=20.0)
    p.add_argument("--weight-ms", type=float, default=10.0)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    launch_flags(p, world=4)
    p.add_argument("--out", default="benchmarks/results/pipeline.json")
    return p


def run(**options: Any) -> dict[str, Any] | None:
    """Rank 0's result of the pipeline rows with ``options`` (the flags)."""
    return run_launched(parser, rank_body, options)


def main(argv: list[str] | None = None) -> int:
    return main_launched(parser, run, tables, argv)


if __name__ == "__main__":
    sys.exit(main())
