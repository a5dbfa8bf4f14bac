"""One reshard row in fresh processes: the spread of a row that depends on the process's
allocator state (issue 22: P -> S(0), 64 MiB on 4 virtual devices, separate shard
buffers, measured 1.0x the copy ceiling in one run and 2.6-2.8x in the next).

- Each run is a new Python process (``python -m benchmarks.spread --child``) that
  builds the simulated suite's inputs (:class:`benchmarks.simulated.Inputs`) and times
  the case interleaved with the copy ceilings, as the simulated section does
  (``x_copy``: the case's median over the ceiling of the bytes that must move).
- Reported: every run's ``x_copy`` and page faults per call, and their min, median
  and max; the target is that every run stays within 2x the copy ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

__all__ = ["run", "tables"]


def _child(case: str, n: int, size: int, repeat: int) -> dict[str, Any]:
    from benchmarks.simulated import Inputs, must_move_bytes
    from benchmarks.timing import interleave

    inputs = Inputs(n, size)
    t = interleave({case: inputs.cases()[case], **inputs.ceilings()}, repeat, warmup=1)
    got, copy = t[case], t["copy_"]
    assert got is not None and copy is not None
    share = must_move_bytes(case, n, inputs.nbytes) / inputs.nbytes
    return {"ms": got["median_s"] * 1e3, "min_ms": got["min_s"] * 1e3,
            "faults_per_call": got["faults"],
            "x_copy": got["median_s"] / (copy["median_s"] * share)}


def run(processes: int = 5, case: str = "P->S(0)", devices: int = 4, size: int = 4096,
        repeat: int = 5, timeout_s: float = 300.0) -> dict[str, Any]:
    """``processes`` fresh runs of ``case``; a run that fails is reported, not raised."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    runs: list[dict[str, Any]] = []
    for _ in range(processes):
        cmd = [sys.executable, "-m", "benchmarks.spread", "--child", "--case", case,
               "--devices", str(devices), "--size", str(size), "--repeat", str(repeat)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root,
                              timeout=timeout_s, check=False)
        if done.returncode != 0:
            runs.append({"error": done.stderr.strip().splitlines()[-1:] or ["failed"]})
            continue
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    xs = [r["x_copy"] for r in runs if "x_copy" in r]
    return {"case": case, "devices": devices, "tensor": [size, size], "repeat": repeat,
            "processes": processes, "runs": runs,
            "x_copy_min": min(xs) if xs else None,
            "x_copy_median": statistics.median(xs) if xs else None,
            "x_copy_max": max(xs) if xs else None}


def tables(res: dict[str, Any]) -> list[str]:
    from benchmarks.common import fmt

    size = res["tensor"]
    lines = [f"\n{res['case']} in {res['processes']} fresh processes ({size[0]}x{size[1]} "
             f"float32, {res['devices']} virtual devices, default allocator; median of "
             f"{res['repeat']} each): x copy ceiling min {fmt(res['x_copy_min'], 0)}, "
             f"median {fmt(res['x_copy_median'], 0)}, max {fmt(res['x_copy_max'], 0)}"]
    for i, r in enumerate(res["runs"]):
        if "error" in r:
            lines.append(f"  run {i}: failed ({r['error'][0]})")
        else:
            lines.append(f"  run {i}: {r['ms']:8.2f} ms  {r['x_copy']:5.2f}x copy  "
                         f"{r['faults_per_call']:7.0f} page faults per call")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", default="P->S(0)")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--processes", type=int, default=5)
    args = p.parse_args(argv)
    if args.child:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(_child(args.case, args.devices, args.size, args.repeat)))
        return 0
    print("\n".join(tables(run(args.processes, args.case, args.devices, args.size,
                                args.repeat))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
