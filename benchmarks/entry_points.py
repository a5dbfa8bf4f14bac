"""Entry-point section: the per-op overhead of one value by how its Tensor was made.

Issue 22, item 2: on the simulated mesh an op ran once on the whole value only for a
Tensor made by ``sw.tensor``; one made by ``sw.shard``, ``from_local`` or a collective
ran block by block. Each row is one (entry point, op) pair on an 8x8 float32 value
over 4 virtual devices, beside the same op on the global tensor in plain torch:

- entry points: ``sw.tensor(g, S(0))``, ``sw.shard(g, mesh, ["x", None])``,
  ``sw.from_local(g.chunk(4), S(0))`` (the blocks are views of one buffer),
  ``from_local`` of 4 separate tensors (``clone`` of each chunk), the output of
  ``sw.all_gather`` (Replicated) and of a reshard S(0) -> S(1) (``sw.shard``), both of
  a separate-blocks ``from_local`` Tensor;
- ops: ``F.gelu(x)``, ``torch.add(x, x)``, ``x * 2 + 1`` (two ops).

The Tensor is made once per row (outside the timing), as a model's activations and
parameters are reused; so a row measures the op, not the entry point. Target: at
most 10 us over plain torch for gelu and add on Tensors made by ``sw.tensor``,
``sw.shard`` and ``from_local`` (both kinds). Timing: interleaved rounds, this
process's CPU time, one torch thread (:mod:`benchmarks.timing`); every result is
checked against torch first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import shardwise as sw
from benchmarks.timing import interleave
from shardwise import DeviceMesh, PlacementMapping, Sharded

__all__ = ["ENTRIES", "OPS", "TARGET_ENTRIES", "TARGET_OPS", "run", "tables"]

OPS: dict[str, Callable[[Any], Any]] = {
    "gelu": F.gelu,
    "add": lambda x: torch.add(x, x),
    "x*2+1": lambda x: x * 2 + 1,
}
ENTRIES = ("sw.tensor", "sw.shard", "from_local (views)", "from_local (separate)",
           "all_gather output", "reshard output")
TARGET_ENTRIES = ENTRIES[:4]
TARGET_OPS = ("gelu", "add")


def _made(entry: str, g: torch.Tensor, mesh: DeviceMesh) -> Any:
    s0 = PlacementMapping(mesh, (Sharded(0),))
    n = mesh.num_devices
    if entry == "sw.tensor":
        return sw.tensor(g, sharding=s0)
    if entry == "sw.shard":
        return sw.shard(g, mesh, ["x", None])
    if entry == "from_local (views)":
        return sw.from_local(list(g.chunk(n)), s0)
    separate = sw.from_local([c.clone() for c in g.chunk(n)], s0)
    if entry == "from_local (separate)":
        return separate
    if entry == "all_gather output":
        return sw.all_gather(separate)
    assert entry == "reshard output", entry
    return sw.shard(separate, mesh, [None, "x"])


def _call(op: Callable[[Any], Any], x: Any) -> Callable[[], Any]:
    return lambda: op(x)


def run(repeat: int = 15, inner: int = 200) -> dict[str, Any]:
    """Every (entry point, op) row, JSON-ready (one torch thread during the run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mesh = DeviceMesh.cpu(4, "x")
        g = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
        rows = []
        for entry in ENTRIES:
            x = _made(entry, g, mesh)
            cases: dict[str, Callable[[], Any] | None] = {}
            for name, op in OPS.items():
                got, want = op(x).to_torch(), op(g)
                # (block by block, gelu's vectorized kernel may round a narrow
                # block's last bits differently: close, not always identical)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
                cases[f"{name}/sw"] = _call(op, x)
                cases[f"{name}/torch"] = _call(op, g)
            t = interleave(cases, repeat, inner=inner, clock=time.process_time)
            for name in OPS:
                a, b = t[f"{name}/sw"], t[f"{name}/torch"]
                assert a is not None and b is not None
                rows.append({"entry": entry, "op": name, "shardwise_us": a["median_s"] * 1e6,
                             "torch_us": b["median_s"] * 1e6,
                             "overhead_us": (a["median_s"] - b["median_s"]) * 1e6,
                             "overhead_min_us": (a["min_s"] - b["min_s"]) * 1e6})
        return {"shape": [8, 8], "devices": mesh.num_devices, "limit_us": 10.0, "rows": rows}
    finally:
        torch.set_num_threads(threads)


def tables(res: dict[str, Any]) -> list[str]:
    lines = ["", f"per-op overhead by entry point, {res['shape'][0]}x{res['shape'][1]} float32 "
             f"on {res['devices']} virtual devices (median us; min over rounds in brackets):",
             f"  {'entry point':24} {'op':7} {'shardwise':>10} {'torch':>7} {'overhead':>9} "
             f"{'(min)':>7}"]
    for r in res["rows"]:
        lines.append(f"  {r['entry']:24} {r['op']:7} {r['shardwise_us']:10.1f} "
                     f"{r['torch_us']:7.1f} {r['overhead_us']:9.1f} "
                     f"({r['overhead_min_us']:5.1f})")
    return lines


def main() -> int:
    print("\n".join(tables(run())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
