"""Peak memory: what a Replicated tensor costs on a simulated mesh.

Replicas on a simulated mesh share one buffer, so a Replicated ``size x size``
float32 tensor on ``n`` virtual devices should cost one tensor's bytes, not
``n``. Measured as the growth of the resident set size (``/proc/self/statm``)
while the result is alive, in a fresh process (``python -m
benchmarks.memory``) so that earlier allocations cannot hide growth; glibc
returns these large blocks to the OS when they are freed (no buffer reuse here).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["measure", "rss_bytes", "run"]

MiB = 2**20


def rss_bytes() -> int | None:
    """Resident set size of this process (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _growth(make: Callable[[], Any]) -> tuple[float | None, Any]:
    gc.collect()
    before = rss_bytes()
    obj = make()
    gc.collect()
    after = rss_bytes()
    return (None if before is None or after is None else (after - before) / MiB), obj


def measure(size: int, n: int, dtensor: bool = True) -> dict[str, Any]:
    """RSS growth (MiB) of each way of holding the value on ``n`` devices."""
    import torch

    import shardwise as sw
    from benchmarks.dtensor_local import LocalDTensor, unavailable

    torch.manual_seed(0)
    mesh = sw.DeviceMesh.cpu((n,), ("x",))
    rep = sw.PlacementMapping(mesh, (sw.Replicated(),))
    s0 = sw.PlacementMapping(mesh, (sw.Sharded(0),))
    warm = sw.tensor(torch.ones(8, 8), sharding=rep)  # imports and caches, not measured
    sw.all_gather(sw.tensor(torch.ones(8, 8), sharding=s0))
    del warm
    x_mib, x = _growth(lambda: torch.randn(size, size))
    rows = [b.clone() for b in x.tensor_split(n, 0)]
    sharded = sw.from_local(rows, s0, shape=(size, size))
    out: dict[str, Any] = {"devices": n, "tensor": [size, size], "dtype": "float32",
                           "tensor_mib": x.numel() * x.element_size() / MiB, "rows": []}

    def row(case: str, mib: float | None, note: str) -> None:
        out["rows"].append({"case": case, "rss_growth_mib": mib, "note": note})

    row("torch.randn(size, size)", x_mib, "the global value itself (reference)")
    mib, held = _growth(lambda: sw.tensor(x, sharding=rep))
    shared = len({s.untyped_storage().data_ptr() for s in held.shards})
    row(f"shardwise.tensor(x, Replicated) on {n} devices", mib,
        f"a copy of x; {shared} distinct buffer(s) for {n} devices")
    del held
    mib, held = _growth(lambda: sw.all_gather(sharded))
    row(f"all_gather(Shard(0) -> Replicated) on {n} devices", mib,
        f"result only (input shards held before); {len({id(s) for s in held.shards})} "
        "distinct buffer(s)")
    del held
    mib, held = _growth(lambda: [x.clone() for _ in range(n)])
    row(f"{n} separate copies (x.clone() per device)", mib, "what replication costs without "
        "sharing")
    del held
    why = unavailable() if dtensor else "skipped (--no-dtensor)"
    if why is None:
        with LocalDTensor(n, rows, [x] * n, x) as dt:
            mib, held = _growth(lambda: dt.cases()["S(0)->R"]())
            distinct = len({t.untyped_storage().data_ptr() for t in held})
            row(f"DTensor LocalTensorMode: Shard(0) -> Replicate on {n} ranks", mib,
                f"redistribute result; {distinct} distinct buffer(s) for {n} ranks")
            del held
    out["dtensor_why_not"] = why
    import resource

    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def run(size: int = 4096, n: int = 8, dtensor: bool = True, timeout_s: float = 300.0
        ) -> dict[str, Any]:
    """:func:`measure` in a fresh Python process (see the module doc)."""
    cmd = [sys.executable, "-m", "benchmarks.memory", "--size", str(size), "--devices",
           str(n)]
    if not dtensor:
        cmd.append("--no-dtensor")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    # the fresh process must find this package wherever the parent was started from
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.pop("MALLOC_MMAP_MAX_", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                          check=False)
    if proc.returncode != 0:
        return {"error": f"exit code {proc.returncode}: {proc.stderr[-2000:]}"}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--no-dtensor", action="store_true")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.size, args.devices, not args.no_dtensor)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
