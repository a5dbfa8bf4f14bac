"""The mixture-of-experts layer of ``examples/moe_gpt.py`` under expert parallelism:
ep = 1, 2, 4 on the simulated mesh and on 4 Gloo processes, dropless and with fixed
capacity, beside plain torch on one device; bytes moved beside the closed form.

One step = the layer's forward and backward on a batch ``[B, T, D]`` (B sequences,
the batch Sharded over ``ep``), its experts ``Sharded(0)`` over ``ep``
(``ExpertParallel``). Bytes are ``CommCounter``'s all_to_all bytes of one forward on
device 0 (rank 0): what it sends to the others, dispatch plus combine. The closed
form per direction, with ``T = B * T_seq / ep`` tokens per rank routed to ``k``
experts of width ``h``: ``T * k * h * (ep - 1) / ep`` elements (dropless, balanced
routing: a router's imbalance moves the measured bytes off it); with capacity, the
slots: ``groups * E * C * h * (ep - 1) / ep``, ``C = ceil(capacity_factor * T_seq * k
/ E)`` per sequence and expert.

Timing: median (and min) of ``--repeat`` steps after one warm-up, one torch thread per
device (simulated: the device threads of one process; Gloo: one per rank); on Gloo the
max over ranks (``benchmarks.common.dist_time``), every rank of a ``(ep, 4 / ep)`` mesh
(the other axis holds replicas, computing the same rows).

    python -m benchmarks.moe                      # from the repo root
    python -m benchmarks.moe --no-gloo --repeat 3
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import dist_time, example, launch_flags, options_of, run_launched, write_json

__all__ = ["main", "parser", "run", "tables"]


def _layer(args: argparse.Namespace) -> Any:
    ex = example("moe_gpt")
    cfg = ex.Config(dim=args.dim, hidden=args.hidden, experts=args.experts, top_k=args.top_k,
                    seq=args.seq)
    torch.manual_seed(0)
    return ex.MoE(cfg)


def _batch(args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.seq, args.dim, generator=g)


def formula_bytes(args: argparse.Namespace, ep: int, capacity_factor: float | None) -> int:
    """Closed-form bytes one device sends per forward, dispatch plus combine (module doc).

    >>> a = parser().parse_args([])
    >>> formula_bytes(a, 2, None) == 2 * (a.batch * a.seq // 2) * a.top_k * a.dim * 4 // 2
    True
    """
    if capacity_factor is None:
        rows = args.batch * args.seq // ep * args.top_k
    else:
        cap = math.ceil(round(capacity_factor * args.seq * args.top_k / args.experts, 9))
        rows = args.batch // ep * args.experts * cap
    return 2 * rows * args.dim * 4 * (ep - 1) // ep


def _parallel(args: argparse.Namespace, mesh: Any, capacity_factor: float | None
              ) -> tuple[Any, Callable[[], None]]:
    """The layer with ExpertParallel over mesh axis ``ep`` and its step."""
    import shardwise as sw
    from shardwise.parallel import ExpertParallel, parallelize_module

    layer = _layer(args)
    parallelize_module(layer.experts, mesh, ExpertParallel(capacity_factor=capacity_factor),
                       axis="ep")
    spread = sw.PlacementMapping(mesh, (sw.Sharded(0), *[sw.Replicated()] * (mesh.ndim - 1)))
    x = sw.tensor(_batch(args), sharding=spread)

    def step() -> None:
        layer(x).sum().backward()
        layer.zero_grad(set_to_none=True)

    return layer, step


def _bytes(step: Callable[[], None]) -> int:
    from shardwise.debug import CommCounter

    with CommCounter() as cc:
        step()
    return int(cc.bytes["all_to_all"])


def _row(args: argparse.Namespace, runtime: str, ep: int, mode: str, timed: dict[str, float],
         measured: int | None, capacity_factor: float | None) -> dict[str, Any]:
    formula = None if ep == 0 else formula_bytes(args, ep, capacity_factor)
    return {"runtime": runtime, "ep": ep, "mode": mode, "ms": timed["median"] * 1e3,
            "min_ms": timed["min"] * 1e3, "bytes": measured, "formula_bytes": formula}


def _modes(args: argparse.Namespace) -> list[tuple[str, float | None]]:
    return [("dropless", None), (f"capacity {args.capacity_factor:g}", args.capacity_factor)]


def _median(fn: Callable[[], None], repeat: int) -> dict[str, float]:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median": statistics.median(times), "min": min(times)}


def simulated_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The layer on one device in plain torch, then on simulated meshes of ep devices,
    all with one torch thread (as each Gloo rank): shard_map's device threads each call
    torch, and an intra-op pool under several of them thrashes on a few cores (DESIGN's
    decisions log has the numbers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulated_rows(args)
    finally:
        torch.set_num_threads(threads)


def _simulated_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import shardwise as sw

    layer, x = _layer(args), _batch(args)

    def torch_step() -> None:
        layer(x).sum().backward()
        layer.zero_grad(set_to_none=True)

    rows = [_row(args, "torch", 0, "one device", _median(torch_step, args.repeat), None, None)]
    for ep in args.eps:
        for mode, factor in _modes(args):
            _, step = _parallel(args, sw.DeviceMesh.cpu(ep, "ep"), factor)
            rows.append(_row(args, "simulated", ep, mode, _median(step, args.repeat),
                             _bytes(step), factor))
    return rows


def rank_body(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every rank: the layer on ``(ep, world / ep)`` meshes over the processes."""
    import torch.distributed as dist

    import shardwise as sw

    world = dist.get_world_size()
    rows = []
    for ep in args.eps:
        if world % ep:
            continue
        mesh = sw.DeviceMesh.cpu((ep, world // ep), ("ep", "rep"))
        for mode, factor in _modes(args):
            _, step = _parallel(args, mesh, factor)
            measured = _bytes(step)
            timed = dist_time({"step": step}, args.repeat, warmup=1)["step"]
            assert timed is not None
            rows.append(_row(args, f"gloo x{world}", ep, mode, timed, measured, factor))
    return rows


def run(**options: Any) -> dict[str, Any]:
    """The simulated rows, and (unless ``gloo=False``) the Gloo rows of rank 0."""
    args = options_of(parser(), options)
    shape = (f"MoE layer: batch {args.batch}x{args.seq}x{args.dim}, {args.experts} experts "
             f"(hidden {args.hidden}), top {args.top_k}")
    res: dict[str, Any] = {"benchmark": "moe", "case": shape,
                           "meta": {"torch": torch.__version__, "cpu_count": os.cpu_count(),
                                    "repeat": args.repeat},
                           "rows": simulated_rows(args)}
    if args.gloo:
        res["rows"] += run_launched(parser, rank_body, {**options, "gloo": False}) or []
    return res


def tables(res: dict[str, Any]) -> list[str]:
    lines = [f"expert parallel: {res['case']}",
             f"  {'runtime':10} {'ep':>3} {'mode':14} {'ms/step':>8} {'min':>8} "
             f"{'bytes':>8} {'formula':>8} {'x form.':>7}"]
    for r in res["rows"]:
        b, f = r["bytes"], r["formula_bytes"]
        lines.append(
            f"  {r['runtime']:10} {r['ep'] or '-':>3} {r['mode']:14} {r['ms']:8.2f} "
            f"{r['min_ms']:8.2f} {'-' if b is None else b:>8} {'-' if f is None else f:>8} "
            f"{'-' if not f else f'{b / f:.3f}':>7}")
    lines.append("  (forward + backward of the layer; bytes: device 0's all_to_all bytes of one "
                 "forward, dispatch + combine, beside the closed form: T*k*h*(ep-1)/ep each "
                 "way, or the capacity slots)")
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8, help="sequences (divisible by 4)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--no-gloo", dest="gloo", action="store_false",
                   help="simulated rows only")
    launch_flags(p, world=4)
    p.add_argument("--out", default="benchmarks/results/moe.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    res = run(**{k: v for k, v in vars(args).items() if k != "out"})
    path = write_json(args.out, res)
    print("\n".join(tables(res)) + f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
