"""The compile section's simulated-mesh row (issue 37 item 3): the GPT example at D=256
trained with its TP x FSDP plan on ``DeviceMesh.cpu((2, 2))``, compiled by
``torch.compile(model)`` (inductor; shardwise routes it to ``compile_backend``), beside
the same model on one device compiled by torch; the target is at most 1.2x compiled
single-device torch.

- The step: forward, the loss (``loss_parallel`` for shardwise), backward, AdamW's
  step and ``zero_grad``, on a batch of 8 sequences Sharded over ``dp``. AdamW is
  ``fused=True``, torchtitan's default (its ``optimizer.implementation``); the
  compiled steps are also timed with AdamW's default on CPU (the single-tensor loop,
  one torch call per op and parameter: 10 dispatches a parameter for shardwise).
- Both eager steps are timed too; all six interleaved (:mod:`benchmarks.timing`),
  one torch thread, the median of ``repeat`` rounds.
- Before timing, two steps of each warm up (the first compiles); the row keeps the
  first calls' seconds and Dynamo's graph breaks over the shardwise compile.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any

__all__ = ["run", "table"]


def run(repeat: int = 15, dim: int = 256) -> dict[str, Any]:
    """The row (JSON-ready)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import shardwise as sw
    from benchmarks.common import example_gpt
    from benchmarks.timing import interleave
    from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
    from shardwise.parallel import loss_parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gpt = example_gpt()
        mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
        config = gpt.Config(dim=dim)
        torch.manual_seed(0)
        ref = gpt.GPT(config)
        model = gpt.parallelize(copy.deepcopy(ref), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
        loop_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_loop_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        x, y = gpt.batch(config, 8, 0)
        data = PlacementMapping(mesh, (Sharded(0), Replicated()))
        xs, ys = sw.tensor(x, sharding=data), sw.tensor(y, sharding=data)
        torch._dynamo.reset()
        counters.clear()
        ours = torch.compile(model, dynamic=False)  # (torch's inductor: routed for shardwise)
        theirs = torch.compile(ref, dynamic=False)

        def step(m: Any, o: Any, a: Any, b: Any, scope: Any) -> Any:
            def call() -> None:
                with scope():
                    m(a, b).backward()
                o.step()
                o.zero_grad()
            return call

        cases = {"shardwise eager": step(model, opt, xs, ys, loss_parallel),
                 "shardwise compiled": step(ours, opt, xs, ys, loss_parallel),
                 "torch eager": step(ref, ref_opt, x, y, contextlib.nullcontext),
                 "torch compiled": step(theirs, ref_opt, x, y, contextlib.nullcontext),
                 "shardwise compiled, AdamW loop": step(ours, loop_opt, xs, ys, loss_parallel),
                 "torch compiled, AdamW loop": step(theirs, ref_loop_opt, x, y,
                                                    contextlib.nullcontext)}
        first = {}
        for name, call in cases.items():
            t0 = time.perf_counter()
            call()
            first[name] = time.perf_counter() - t0
        breaks = sum(counters["graph_break"].values())
        t = interleave(cases, repeat)
        ms = {k: v["median_s"] * 1e3 for k, v in t.items() if v is not None}
        return {"case": f"GPT example D={dim}, TP x FSDP on DeviceMesh.cpu((2, 2)), batch 8, "
                        "training step with AdamW(fused=True)",
                "ms": ms, "first_s": first, "graph_breaks": breaks,
                "ratio": ms["shardwise compiled"] / ms["torch compiled"],
                "ratio_eager": ms["shardwise eager"] / ms["torch eager"],
                "ratio_adamw_loop": (ms["shardwise compiled, AdamW loop"]
                                     / ms["torch compiled, AdamW loop"])}
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()


def table(row: dict[str, Any]) -> list[str]:
    """The row as text lines."""
    ms = row["ms"]
    return [f"compile: {row['case']} (median ms)",
            f"  shardwise eager {ms['shardwise eager']:.2f}, compiled "
            f"{ms['shardwise compiled']:.2f} | torch (one device) eager "
            f"{ms['torch eager']:.2f}, compiled {ms['torch compiled']:.2f} | compiled "
            f"{row['ratio']:.2f}x torch compiled (eager {row['ratio_eager']:.2f}x); first "
            f"compiled step {row['first_s']['shardwise compiled']:.1f} s, breaks "
            f"{row['graph_breaks']}",
            f"  with AdamW's default loop (fused=False): shardwise compiled "
            f"{ms['shardwise compiled, AdamW loop']:.2f}, torch compiled "
            f"{ms['torch compiled, AdamW loop']:.2f}: {row['ratio_adamw_loop']:.2f}x"]
