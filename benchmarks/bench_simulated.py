"""Simulated-mesh benchmark: reshards and collectives beside a plain torch copy.

Writes JSON (default benchmarks/results/simulated.json) and prints a table.
Times are medians of repeated runs after warm-up, in one process, so ratios
against the copy ceiling are comparable within a run.

    python benchmarks/bench_simulated.py --size 4096 --devices 4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import shardwise as sw
from shardwise import DeviceMesh, Partial, PlacementMapping, Replicated, Sharded


def timeit(fn: Callable[[], Any], repeat: int, min_time: float = 0.0) -> float:
    """Median seconds of one call of ``fn`` over ``repeat`` runs (after 2 warm-ups)."""
    for _ in range(2):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < repeat or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(size: int, devices: int, repeat: int, small: int = 8) -> dict[str, Any]:
    torch.set_num_threads(torch.get_num_threads())
    mesh = DeviceMesh.cpu((devices,), ("x",))
    x = torch.randn(size, size)
    nbytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)

    def pm(p: Any) -> PlacementMapping:
        return PlacementMapping(mesh, [p])

    s0 = sw.tensor(x, sharding=pm(Sharded(0)))
    s1 = pm(Sharded(1))
    rep = pm(Replicated())
    part = sw.tensor(x, sharding=pm(Partial()))
    repl = sw.tensor(x, sharding=rep)
    ring = [(i, (i + 1) % devices) for i in range(devices)]
    cases: dict[str, Callable[[], Any]] = {
        "copy ceiling (dst.copy_(src), same bytes)": lambda: dst.copy_(x),
        "clone (fresh buffer, same bytes)": lambda: x.clone(),
        "Shard(0)->Replicated (all_gather)": lambda: sw.all_gather(s0),
        "Shard(0)->Shard(1) (all_to_all)": lambda: sw.shard(s0, dim_specs=s1),
        "Partial->Replicated (all_reduce)": lambda: sw.all_reduce(part),
        "Partial->Shard(0) (reduce_scatter)": lambda: sw.reduce_scatter(part, 0),
        "Replicated->Shard(0) (slice)": lambda: sw.shard(repl, dim_specs=pm(Sharded(0))),
        "ppermute ring": lambda: sw.ppermute(s0, ring),
    }
    results = []
    copy_s = None
    for name, fn in cases.items():
        sec = timeit(fn, repeat)
        copy_s = copy_s or sec
        results.append({"case": name, "seconds": sec, "ratio_to_copy": sec / copy_s,
                        "GBps": nbytes / sec / 1e9})
    xs = torch.randn(small, small)
    t_small = sw.tensor(xs, sharding=pm(Sharded(0)))
    p_small = sw.tensor(xs, sharding=pm(Partial()))
    overhead = {
        "all_gather": lambda: sw.all_gather(t_small),
        "all_to_all (Shard(0)->Shard(1))": lambda: sw.all_to_all(t_small, 1, 0),
        "all_reduce (Partial->Replicated)": lambda: sw.all_reduce(p_small),
        "reduce_scatter": lambda: sw.reduce_scatter(p_small, 0),
        "ppermute ring": lambda: sw.ppermute(t_small, ring),
        "torch.cat of the 8x8 shards (reference)": lambda: torch.cat(t_small.shards),
    }
    small_results = [{"case": name, "microseconds": timeit(fn, 200, 0.2) * 1e6}
                     for name, fn in overhead.items()]
    return {
        "benchmark": "simulated",
        "tensor": [size, size], "dtype": "float32", "bytes": nbytes, "devices": devices,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "python": platform.python_version(),
        "large": results, "small": small_results, "small_shape": [small, small],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/simulated.json")
    args = parser.parse_args()
    res = run(args.size, args.devices, args.repeat)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"{res['tensor']} float32 ({res['bytes'] / 2**20:.0f} MiB) on {args.devices} "
          f"virtual devices, torch {res['torch']}, {res['threads']} threads")
    print(f"{'case':48} {'ms':>9} {'x copy':>8} {'GB/s':>7}")
    for r in res["large"]:
        print(f"{r['case']:48} {r['seconds'] * 1e3:9.2f} {r['ratio_to_copy']:8.2f} "
              f"{r['GBps']:7.1f}")
    print(f"\nper-op overhead, {res['small_shape']} float32:")
    for r in res["small"]:
        print(f"  {r['case']:46} {r['microseconds']:8.1f} us")
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
