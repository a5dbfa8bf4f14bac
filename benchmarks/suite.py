"""``shardwise bench``: the whole suite in one go, JSON + a table.

Sections (each documented in its module):
- ``simulated``: every reshard transition and collective on 4 and 8 virtual
  devices, 64 MiB and 8x8, beside the copy ceiling and DTensor LocalTensorMode,
  under glibc's default allocator and with buffer reuse;
- ``spread``: P->S(0) (64 MiB, 4 virtual devices) in fresh processes, the spread of
  a row that depends on the allocator's state (:mod:`benchmarks.spread`);
- ``memory``: what a Replicated tensor costs on 8 virtual devices (fresh process);
- ``profile``: cProfile of the 8x8 hot path;
- ``torch``: torch ops and training steps on shardwise Tensors beside plain torch:
  a Megatron MLP, the GPT sharded by hand, and the plan-driven GPT and tiny HF Llama
  (TP x ``fully_shard``) (:mod:`benchmarks.torchnative`);
- ``entry_points``: the per-op overhead of an 8x8 value by how its Tensor was made
  (``sw.tensor``, ``sw.shard``, ``from_local``, a collective's output) beside plain
  torch (:mod:`benchmarks.entry_points`);
- ``compile``: ``torch.compile`` of a parallelized tiny HF Llama forward beside the
  eager one, and its forward and training step eager and compiled beside DTensor's on
  2 Gloo ranks (:mod:`benchmarks.compiled`; says so when transformers is missing);
- ``attention``: context-parallel attention (ring, all-to-all) at cp = 1, 2, 4 beside
  full attention and the all_gather-the-sequence baseline, simulated and on cp Gloo
  ranks, with CommCounter bytes beside the closed forms (:mod:`benchmarks.attention`);
- ``gloo``: 4 Gloo ranks, shardwise beside raw torch.distributed and DTensor;
- ``dispatch``: per-op overhead of the process runtime (2 Gloo ranks, a 32x64 block per
  rank) above plain torch, shardwise beside DTensor and a minimal wrapper subclass (the
  floor) (:mod:`benchmarks.dispatch`);
- ``gpt_gloo``: a GPT training step, TP x FSDP on 4 Gloo ranks, shardwise beside
  DTensor TP + FSDP2 (:mod:`benchmarks.gpt_gloo`);
- ``pipeline``: every pipeline schedule on 4 Gloo processes with stages of calibrated
  cost, measured beside ``simulate()``'s prediction and beside
  ``torch.distributed.pipelining`` (:mod:`benchmarks.pipeline`; ``quick``: 1F1B alone);
- ``checkpoint``: DCP and safetensors throughput of a sharded state beside plain
  tensors, and the peak memory of a sharded safetensors load
  (:mod:`benchmarks.checkpoint`, fresh processes);
- ``moe``: the mixture-of-experts layer of ``examples/moe_gpt.py`` under expert
  parallelism at ep = 1, 2, 4 (simulated, and on 4 Gloo ranks unless ``--no-gloo``),
  dropless and with capacity, beside plain torch; all_to_all bytes beside the closed
  form (:mod:`benchmarks.moe`).
- ``planning``: 13 plans of a small GPT measured on 4 Gloo ranks in rounds, with
  ``calibrate``'s measurements between them, then predicted against measured step
  time and ``auto_plan``'s pick; the scale rows (a
  Llama-3-8B-sized config on 1,024 devices, 70B on 4,096, ``auto_plan`` for 8B) in
  fresh processes (:mod:`benchmarks.planning`; ``quick``: a smaller GPT, no scale rows).

Presets: ``full`` (about 15 minutes on 2 cores, 3 of them the ``planning`` section's
scale rows) and ``quick`` (about 30 s; 4 MiB tensors, fewer repeats).
Timings are medians of interleaved runs; on a shared machine compare the ratios
within one run (the table header shows the load).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "main", "run_suite"]

PRESETS: dict[str, dict[str, Any]] = {
    "full": {"size": 4096, "small": 8, "repeat": 7, "small_repeat": 15, "small_inner": 200,
             "profile_calls": 2000, "gloo": {"size": 4096, "repeat": 11, "small_repeat": 200,
                                             "choices": True},
             "ckpt": {"tensors": 8, "repeat": 3, "shape": (2048, 4096)},
             "gpt": {"repeat": 10, "dims": (32, 256)},
             "dispatch": {"repeat": 21, "inner": 200},
             "spread": {"processes": 5, "repeat": 5},
             "pipeline": {"repeat": 7},
             "attention": {"seq": 1024, "repeat": 5},
             "moe": {"repeat": 7},
             "planning": {"repeat": 7, "quick": False, "do_scale": True}},
    "quick": {"size": 1024, "small": 8, "repeat": 3, "small_repeat": 6, "small_inner": 50,
              "profile_calls": 300, "gloo": {"size": 1024, "repeat": 3, "small_repeat": 20,
                                             "choices": False},
              "ckpt": {"tensors": 2, "repeat": 1, "shape": (1024, 1024)},
              "gpt": {"repeat": 3, "dims": (32,)},
              "dispatch": {"repeat": 7, "inner": 50},
              "spread": {"processes": 2, "repeat": 3},
              "attention": {"seq": 512, "repeat": 3},
              "pipeline": {"repeat": 3, "schedules": ["1F1B"], "forward_ms": 4.0,
                           "backward_ms": 8.0, "weight_ms": 4.0},
              "moe": {"repeat": 3, "seq": 16, "dim": 32, "hidden": 64},
              "planning": {"repeat": 3, "quick": True, "do_scale": False}},
}


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def run_suite(preset: str = "full", *, devices: tuple[int, ...] = (4, 8), gloo: bool = True,
              dtensor: bool = True, memory: bool = True, profile: bool = True,
              modes: tuple[str, ...] = ("default", "reuse"), world: int = 4,
              checkpoint: bool = True, compile: bool = True, log: Any = None,
              **overrides: Any) -> dict[str, Any]:
    """Run the sections and return the JSON-ready result (with ``targets``).

    ``overrides`` replace preset entries (``size``, ``repeat``, ``small_repeat``,
    ``small_inner``, ``profile_calls``, ``gloo`` (a dict of Gloo options),
    ``ckpt`` (the checkpoint section: ``tensors``, ``repeat``, ``shape``)).
    """
    import torch

    from benchmarks import memory as memory_mod
    from benchmarks import simulated
    from benchmarks.report import check_targets

    cfg = {**PRESETS[preset], **overrides}
    say = log or (lambda msg: None)
    start, t0 = _loadavg(), time.perf_counter()
    res: dict[str, Any] = {"meta": {
        "preset": preset, "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(), "config": {k: v for k, v in cfg.items()},
        "loadavg_start": start,
    }}
    say(f"simulated suite ({', '.join(map(str, devices))} devices, {cfg['size']}^2 and "
        f"{cfg['small']}^2 float32) ...")
    res["simulated"] = simulated.run(
        devices=devices, size=cfg["size"], small=cfg["small"], repeat=cfg["repeat"],
        small_repeat=cfg["small_repeat"], small_inner=cfg["small_inner"], modes=modes,
        dtensor=dtensor)
    from benchmarks import torchnative

    say("torch-native ops and training step ...")
    res["torch"] = torchnative.run(repeat=cfg["small_repeat"], inner=cfg["small_inner"])
    from benchmarks import entry_points

    say("per-op overhead by entry point ...")
    res["entry_points"] = entry_points.run(repeat=cfg["small_repeat"],
                                           inner=cfg["small_inner"])
    from benchmarks import attention

    say("context-parallel attention (cp = 1, 2, 4) ...")
    res["attention"] = attention.run(gloo=gloo, log=say, **cfg["attention"])
    if compile:
        from benchmarks import compiled

        say("torch.compile of a parallelized Llama forward beside eager ...")
        res["compile"] = compiled.run(repeat=cfg["small_repeat"], gloo=gloo)
    if memory:
        from benchmarks import spread

        sp = cfg["spread"]
        say(f"P->S(0) in {sp['processes']} fresh processes (the spread of a row that "
            "depends on the allocator's state) ...")
        res["spread"] = spread.run(sp["processes"], "P->S(0)", min(devices), cfg["size"],
                                   sp["repeat"])
        say("peak memory (fresh process) ...")
        res["memory"] = memory_mod.run(size=cfg["size"], n=max(devices), dtensor=dtensor)
    if profile:
        from benchmarks.profiling import profile_small

        say("profile of the 8x8 hot path ...")
        res["profile"] = profile_small(n=max(devices), size=cfg["small"],
                                       calls=cfg["profile_calls"])
    if checkpoint:
        from benchmarks import checkpoint as checkpoint_mod

        c = cfg["ckpt"]
        say(f"checkpoints ({c['tensors']} x {c['shape'][0]}x{c['shape'][1]} float32) ...")
        res["checkpoint"] = checkpoint_mod.run(c["tensors"], c["repeat"], tuple(c["shape"]))
    if gloo:
        from benchmarks import gloo as gloo_mod

        say(f"Gloo suite ({world} ranks) ...")
        res["gloo"] = gloo_mod.run(world=world, **cfg["gloo"])
        from benchmarks import dispatch

        say("per-op dispatch on 2 Gloo ranks beside DTensor and the floor ...")
        res["dispatch"] = dispatch.run(**cfg["dispatch"])
        from benchmarks import gpt_gloo

        res["gpt_gloo"] = []
        for dim in cfg["gpt"]["dims"]:
            say(f"GPT step, TP x FSDP on {world} Gloo ranks (dim {dim}) beside DTensor ...")
            res["gpt_gloo"].append(gpt_gloo.run(world=world, dim=dim,
                                                repeat=cfg["gpt"]["repeat"]))
        from benchmarks import pipeline

        say(f"pipeline schedules on {world} Gloo ranks beside simulate() and torch's "
            "pipelining ...")
        res["pipeline"] = pipeline.run(world=world, **cfg["pipeline"])
        from benchmarks import planning

        say(f"planning: calibrate, predicted vs measured step time on {world} Gloo ranks, "
            "scale ...")
        res["planning"] = planning.run(world=world, log=say, **cfg["planning"])
    else:
        res["gloo_skipped"] = "skipped (--no-gloo)"
    from benchmarks import moe

    say("mixture-of-experts layer under expert parallelism (ep = 1, 2, 4) ...")
    res["moe"] = moe.run(gloo=gloo, world=world, **cfg["moe"])
    res["meta"]["loadavg_end"] = _loadavg()
    res["meta"]["seconds"] = time.perf_counter() - t0
    res["targets"] = check_targets(res)
    return res


def write(res: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    """``bench.json`` and ``bench.txt`` (the table) under ``out``."""
    from benchmarks.common import write_json
    from benchmarks.report import tables

    folder = Path(out)
    path = write_json(folder / "bench.json", res)
    text = folder / "bench.txt"
    text.write_text(tables(res) + "\n")
    return path, text


def parser(prog: str = "python -m benchmarks") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="4 MiB tensors and fewer repeats (about 30 s)")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help="folder for bench.json and bench.txt (default: ./bench-results)")
    p.add_argument("--no-gloo", action="store_true", help="skip the multi-process Gloo suite")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="skip the checkpoint throughput and memory section")
    p.add_argument("--no-compile", action="store_true",
                   help="skip the torch.compile section (its first call compiles, ~20 s)")
    p.add_argument("--no-dtensor", action="store_true",
                   help="skip DTensor LocalTensorMode on the simulated mesh")
    p.add_argument("--devices", type=int, nargs="+", default=[4, 8], metavar="N",
                   help="virtual device counts of the simulated suite (default: 4 8)")


def run_from_args(args: argparse.Namespace) -> int:
    from benchmarks.report import tables

    res = run_suite("quick" if args.quick else "full", devices=tuple(args.devices),
                    gloo=not args.no_gloo, dtensor=not args.no_dtensor,
                    checkpoint=not args.no_checkpoint, compile=not args.no_compile,
                    log=lambda msg: print(msg, file=sys.stderr, flush=True))
    path, text = write(res, args.out)
    print(tables(res))
    print(f"\nJSON: {path}\ntable: {text}")
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks") -> int:
    """Parse ``argv`` (``--quick``, ``--out DIR``, ...), run the suite, write and print."""
    return run_from_args(parser(prog).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
