"""Per-op dispatch overhead in the process runtime: shardwise beside DTensor and the floor.

On ``world`` (2) Gloo ranks, each rank holds one 32x64 float32 block of each Sharded(0)
operand (weights Replicated) and runs gelu, add, sum(1), linear, softmax, layer_norm
and sdpa four ways: plain torch on the local blocks, the floor (a minimal wrapper
subclass, :class:`benchmarks.floor.Floor`), DTensor (``from_local`` on a ``world``-rank
mesh) and shardwise (``from_local`` on a ``world``-process mesh). None of these ops
communicates, so each rank times its own calls: every round runs each way ``inner``
times in a rotating order, timed in this process's CPU time (``time.process_time``:
robust to other processes on a shared machine); a way's overhead is the median over
rounds of (its time - torch's time in the same round), the max over ranks. Every
result is checked against the torch result on the local blocks before timing.

Target (issue 22): shardwise's overhead <= 0.75x DTensor's, or within 1.5 us of the
floor's. ``profile``: an op name to cProfile (shardwise only, in CPU time) on rank 0.
``--device cuda``: the blocks on each rank's GPU over NCCL (``--world 1``: one GPU;
DTensor on a one-device mesh), timed in wall time with the GPU synchronized after
each way's calls (a dedicated machine; the ways are still interleaved).

    python -m benchmarks.dispatch                     # from the repo root
    python -m benchmarks.dispatch --profile gelu
    python -m benchmarks.dispatch --device cuda --world 1
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["OPS", "main", "run", "tables"]

OPS = ("gelu", "add", "sum(1)", "linear", "softmax", "layer_norm", "sdpa")
WAYS = ("torch", "floor", "dtensor", "shardwise")
TARGET = "overhead <= 0.75x DTensor's or within 1.5 us of the floor"


def _calls() -> dict[str, tuple[Callable[..., Any], tuple[str, ...]]]:
    """Each op: the call on its operands and the operands' names (see ``_inputs``)."""
    import torch
    import torch.nn.functional as F

    return {
        "gelu": (lambda x: F.gelu(x), ("x",)),
        "add": (lambda x, y: x + y, ("x", "y")),
        "sum(1)": (lambda x: x.sum(1), ("x",)),
        "linear": (lambda x, w, b: F.linear(x, w, b), ("x", "w", "b")),
        "softmax": (lambda x: torch.softmax(x, -1), ("x",)),
        "layer_norm": (lambda x, g, b: F.layer_norm(x, (64,), g, b), ("x", "g", "b")),
        "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), ("q", "k", "v")),
    }


def _inputs(rank: int, world: int, device: str = "cpu") -> dict[str, tuple[Any, bool]]:
    """name -> (this rank's local tensor, Sharded(0)?); replicated ones are global.
    Drawn on the CPU, then moved: the same values on every device."""
    import torch

    g = torch.Generator().manual_seed(rank)
    rep = torch.Generator().manual_seed(1000)
    dev = torch.device("cpu") if device == "cpu" else torch.device(
        device, torch.cuda.current_device())
    return {k: (t.to(dev), s) for k, (t, s) in {
        "x": (torch.randn(32, 64, generator=g), True),
        "y": (torch.randn(32, 64, generator=g), True),
        "w": (torch.randn(64, 64, generator=rep), False),
        "b": (torch.randn(64, generator=rep), False),
        "g": (torch.randn(64, generator=rep), False),
        "q": (torch.randn(1, 32, 64, generator=g), True),
        "k": (torch.randn(1, 32, 64, generator=g), True),
        "v": (torch.randn(1, 32, 64, generator=g), True),
    }.items()}


def _ways(world: int, device: str = "cpu"
          ) -> dict[str, tuple[Callable[[Any, bool], Any], Callable[[Any], Any]]]:
    """way -> (wrap a local tensor (sharded?), the local tensor of a result)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

    import shardwise as sw
    from benchmarks.floor import Floor
    from shardwise.sharding import DeviceMesh, PlacementMapping, Replicated, Sharded

    rank = dist.get_rank()
    dmesh = init_device_mesh(device, (world,))
    mesh: DeviceMesh = sw.init_device_mesh(device, (world,), ("x",))

    def shardwise(t: Any, sharded: bool) -> Any:
        spec = PlacementMapping(mesh, (Sharded(0) if sharded else Replicated(),))
        shape = (t.shape[0] * world, *t.shape[1:]) if sharded else tuple(t.shape)
        return sw.from_local([t if k == rank else None for k in range(world)], spec,
                             shape=shape)

    def dtensor(t: Any, sharded: bool) -> Any:
        return DTensor.from_local(t, dmesh, [Shard(0) if sharded else Replicate()],
                                  run_check=False)

    return {
        "torch": (lambda t, s: t, lambda r: r),
        "floor": (lambda t, s: Floor(t), lambda r: r.local),
        "dtensor": (dtensor, lambda r: r.to_local()),
        "shardwise": (shardwise, lambda r: r.shards[rank]),
    }


def _time_op(fns: dict[str, Callable[[], Any]], repeat: int, inner: int,
             sync: Callable[[], Any] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each way, per round (rotating order; CPU time, or with
    ``sync`` (a GPU's) wall time up to the end of the calls' kernels)."""
    names = list(fns)
    for _ in range(max(3, inner // 10)):
        for f in fns.values():
            f()
    out: dict[str, list[float]] = {k: [] for k in names}
    clock = time.process_time if sync is None else time.perf_counter
    for i in range(repeat):
        for j in range(len(names)):
            k = names[(i + j) % len(names)]
            f = fns[k]
            if sync is not None:
                sync()
            t0 = clock()
            for _ in range(inner):
                f()
            if sync is not None:
                sync()
            out[k].append((clock() - t0) / inner)
    return out


def rank_body(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    device = getattr(args, "device", "cpu")
    sync = None if device == "cpu" else torch.cuda.synchronize
    data = _inputs(rank, world, device)
    ways = _ways(world, device)
    wrapped = {w: {n: wrap(t, s) for n, (t, s) in data.items()}
               for w, (wrap, _) in ways.items()}
    rows: list[dict[str, Any]] = []
    prof: dict[str, Any] | None = None
    for op, (call, names) in _calls().items():
        if args.ops and op not in args.ops:
            continue
        fns: dict[str, Callable[[], Any]] = {}
        notes: dict[str, str] = {}
        want = call(*(data[n][0] for n in names))
        for w, (_, local) in ways.items():
            ins = tuple(wrapped[w][n] for n in names)
            try:
                got = local(call(*ins))
            except Exception as err:  # a way without this op: a null column
                notes[w] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                continue
            if got.shape != want.shape or got.dtype != want.dtype or not torch.allclose(
                    got, want, rtol=1e-5, atol=1e-6):
                raise AssertionError(f"{op} {w}: local result differs from torch's")
            fns[w] = functools.partial(call, *ins)
        if args.profile == op and "shardwise" in fns:
            prof = _profile(fns["shardwise"], args.profile_calls) if rank == 0 else None
        t = _time_op(fns, args.repeat, args.inner, sync)
        base = t["torch"]
        med = {w: statistics.median(t[w]) if w in t else float("nan") for w in WAYS}
        over = {w: statistics.median(a - b for a, b in zip(t[w], base))
                if w in t and w != "torch" else float("nan") for w in WAYS}
        vals = torch.tensor([med["torch"], *(over[w] for w in WAYS[1:])], dtype=torch.float64,
                            device=data["x"][0].device)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)  # the slower rank (NaN: not measured)
        torch_us, floor_us, dt_us, sw_us = (float(v) * 1e6 for v in vals)
        row = {"op": op, "torch_us": torch_us, "floor_us": _num(floor_us),
               "dtensor_us": _num(dt_us), "shardwise_us": _num(sw_us),
               "sw_over_dt": _num(sw_us / dt_us) if dt_us == dt_us and dt_us > 0 else None,
               "notes": notes}
        row["met"] = _met(row)
        rows.append(row)
    return {"benchmark": "dispatch", "rows": rows, "profile": prof, "meta": {
        "world_size": world, "backend": dist.get_backend(), "device": device,
        "block": [32, 64], "dtype": "float32", "repeat": args.repeat,
        "inner": args.inner, "threads_per_rank": torch.get_num_threads(),
        "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "timing": ("process_time" if sync is None else "perf_counter, GPU synchronized "
                   "around each way's calls") + "; per round each way x inner calls, "
                  "rotating order; overhead = median over rounds of (way - torch), max over "
                  "ranks"}}


def _num(v: float) -> float | None:
    return None if v != v else v


def _met(row: dict[str, Any]) -> bool | None:
    sw, dt, fl = row["shardwise_us"], row["dtensor_us"], row["floor_us"]
    if sw is None:
        return None
    return (dt is not None and sw <= 0.75 * dt) or (fl is not None and sw <= fl + 1.5)


def _profile(fn: Callable[[], Any], calls: int) -> dict[str, Any]:
    from benchmarks.profiling import profile_calls

    # CPU time: robust to a loaded machine
    return profile_calls(fn, calls, 14, warmup=200, timer=time.process_time)


def tables(res: dict[str, Any]) -> list[str]:
    """The section as text lines."""
    from benchmarks.common import fmt

    m = res["meta"]
    backend = str(m.get("backend", "gloo")).replace("gloo", "Gloo").replace("nccl", "NCCL")
    on = "" if m.get("device", "cpu") == "cpu" else f" on {m['device']}"
    lines = [f"per-op dispatch, process runtime: {m['world_size']} {backend} ranks, one "
             f"{m['block'][0]}x{m['block'][1]} float32 block per rank{on}, "
             f"{m['threads_per_rank']} "
             f"thread/rank; overhead above torch on the local block (us, median over "
             f"{m['repeat']} rounds of {m['inner']}, max over ranks)",
             f"  {'op':12} {'torch us':>9} {'floor +us':>10} {'DTensor +us':>12} "
             f"{'shardwise +us':>14} {'sw/DT':>6}  target"]
    for r in res["rows"]:
        met = {True: "met", False: "MISSED", None: "-"}[r["met"]]
        lines.append(f"  {r['op']:12} {r['torch_us']:9.1f} {fmt(r['floor_us'], 10, 1)} "
                     f"{fmt(r['dtensor_us'], 12, 1)} {fmt(r['shardwise_us'], 14, 1)} "
                     f"{fmt(r['sw_over_dt'], 6)}  {met}")
        for w, why in r["notes"].items():
            lines.append(f"      {w}: not measured ({why})")
    lines.append(f"  target: {TARGET}")
    p = res.get("profile")
    if p:
        lines.append(f"  cProfile of shardwise {res.get('profiled_op')}: "
                     f"{p['profiled_us_per_op']:.1f} us/op profiled, "
                     f"{p['functions_per_op']:.0f} function calls/op; own time per op:")
        for f in p["top"]:
            lines.append(f"    {f['tottime_us']:7.2f} us  x{f['ncalls_per_op']:<4.0f} "
                         f"{f['function']}")
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from benchmarks.common import launch_flags

    launch_flags(p, world=2)
    p.add_argument("--repeat", type=int, default=21, help="rounds")
    p.add_argument("--inner", type=int, default=200, help="calls per way per round")
    p.add_argument("--ops", nargs="*", default=[], help=f"a subset of {', '.join(OPS)}")
    p.add_argument("--profile", default=None, help="cProfile this op (shardwise)")
    p.add_argument("--profile-calls", type=int, default=3000)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the blocks live (cuda: NCCL, one GPU per rank)")
    p.add_argument("--out", default=None, help="write the JSON here")
    return p


def run(**options: Any) -> dict[str, Any] | None:
    """The section with ``options`` (the command-line flags, as keywords)."""
    from benchmarks.common import options_of, run_launched

    res = run_launched(parser, rank_body, options)
    if res is not None:
        res["profiled_op"] = options_of(parser(), options).profile
    return res


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    res = run(**{k: v for k, v in vars(args).items() if k != "out"})
    if res is not None:
        print("\n".join(tables(res)))
        if args.out:
            from benchmarks.common import write_json

            print(f"JSON: {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
