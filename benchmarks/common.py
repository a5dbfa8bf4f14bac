"""Shared helpers of the multi-process benchmarks: launch, timing over ranks, output.

- :func:`launch` runs ``body(args)`` on every rank: under ``torchrun`` (``RANK`` set)
  in this process, otherwise on ``world`` ranks it spawns itself (torch.multiprocessing,
  Gloo on 127.0.0.1, or NCCL with rank r on GPU r; a free port, a wall-clock limit;
  stragglers are killed).
  Rank 0's return value comes back; a failure on any rank raises with its traceback.
- :func:`dist_time` times calls the same way on every rank: barrier, then
  ``time.perf_counter`` around the call; the time of an iteration is the max over
  ranks (one all_reduce MAX at the end); the result is the median over iterations.
  The calls being compared are interleaved, so load drift hits them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import queue as queue_mod
import random
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["dist_time", "example", "example_gpt", "fmt", "free_port", "launch", "options_of",
           "ratio", "write_json"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dist_time(fns: dict[str, Callable[[], Any] | None], repeat: int, warmup: int = 2,
              shuffle: bool = False) -> dict[str, dict[str, float] | None]:
    """Seconds per call of each of ``fns`` (collectives every rank runs), interleaved
    (one call of each per iteration, the order rotating) so that drift in a noisy
    machine's load hits them alike: median (and min) over ``repeat`` iterations of
    the max over ranks, after ``warmup`` calls of each. None entries give None.
    ``shuffle``: each iteration's order is a permutation drawn from a fixed seed (the
    same on every rank), not a rotation, in which each call follows the same
    neighbour: what a heavy call leaves behind (freed memory, garbage) then falls on
    every call alike instead of on its fixed successor."""
    import torch
    import torch.distributed as dist

    active = {k: f for k, f in fns.items() if f is not None}
    names, calls = list(active), list(active.values())
    for _ in range(warmup):
        for fn in calls:
            dist.barrier()
            fn()
    times = torch.empty(len(calls), repeat, dtype=torch.float64)
    rng = random.Random(0)
    for i in range(repeat):
        order = [(i + j) % len(calls) for j in range(len(calls))]
        if shuffle:
            rng.shuffle(order)
        for k in order:
            dist.barrier()
            t0 = time.perf_counter()
            calls[k]()
            times[k, i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    out: dict[str, dict[str, float] | None] = dict.fromkeys(fns)
    for name, row in zip(names, times.tolist()):
        out[name] = {"median": statistics.median(row), "min": min(row)}
    return out


def _init_rank(rank: int, world: int, port: int | None, timeout_s: float,
               backend: str = "gloo") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import shardwise.distributed as sd

    if port is None:  # torchrun: the environment names the rendezvous
        sd.initialize(backend, timeout_s=timeout_s)
    else:
        os.environ["LOCAL_RANK"] = str(rank)  # (NCCL: rank r on GPU r)
        sd.initialize(backend, rank=rank, world_size=world, master_addr="127.0.0.1",
                      master_port=port, timeout_s=timeout_s)


def _worker(rank: int, world: int, port: int, body: Callable[[Any], Any], args: Any,
            out: Any, timeout_s: float, backend: str = "gloo") -> None:
    import shardwise.distributed as sd

    try:
        _init_rank(rank, world, port, timeout_s, backend)
        res = body(args)
        out.put((rank, True, res if rank == 0 else None))
    except BaseException:  # every failure goes to the parent
        out.put((rank, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):  # best effort at teardown
            sd.shutdown()


def options_of(parser: argparse.ArgumentParser, options: dict[str, Any]) -> argparse.Namespace:
    """A section's command-line defaults with ``options`` (its flags, as keywords) set:
    what its ``run(**options)`` runs with; an unknown option is a TypeError.

    >>> p = argparse.ArgumentParser(); _ = p.add_argument("--world", type=int, default=2)
    >>> options_of(p, {"world": 4}).world
    4
    """
    args = parser.parse_args([])
    for k, v in options.items():
        if not hasattr(args, k):
            raise TypeError(f"run() got an unknown option {k!r}")
        setattr(args, k, v)
    return args


def launch(body: Callable[[Any], Any], args: Any, world: int, *, limit_s: float,
           timeout_s: float, backend: str = "gloo") -> Any:
    """Rank 0's ``body(args)`` (None on other torchrun ranks); see the module doc."""
    if "RANK" in os.environ:  # launched by torchrun: this process is one rank
        import shardwise.distributed as sd

        _init_rank(-1, -1, None, timeout_s, backend)
        try:
            res = body(args)
            return res if sd.process_index() == 0 else None
        finally:
            sd.shutdown()
    old_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    try:
        return _spawn(body, args, world, limit_s=limit_s, timeout_s=timeout_s,
                      backend=backend)
    finally:
        if old_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_threads


def _spawn(body: Callable[[Any], Any], args: Any, world: int, *, limit_s: float,
           timeout_s: float, backend: str = "gloo") -> Any:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker,
                         args=(r, world, port, body, args, out, timeout_s, backend),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + limit_s
    try:
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, ok, res = out.get(timeout=0.5)
                got[rank] = (ok, res)
                if not ok:
                    break
            except queue_mod.Empty:
                pass
            dead = [r for r, p in enumerate(procs)
                    if r not in got and p.exitcode is not None and p.exitcode != 0]
            if dead:
                got[dead[0]] = (False, f"rank {dead[0]} exited with code "
                                       f"{procs[dead[0]].exitcode} without reporting")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == world else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failed = {r: res for r, (ok, res) in got.items() if not ok}
    if failed:
        r, tb = next(iter(sorted(failed.items())))
        raise RuntimeError(f"benchmark failed on rank {r}:\n{tb}")
    if len(got) < world:
        missing = sorted(set(range(world)) - set(got))
        raise RuntimeError(f"ranks {missing} did not finish within {limit_s:.0f} s (killed)")
    return got[0][1]


def write_json(path: str | Path, obj: Any) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(obj, indent=2) + "\n")
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt(x: float | None, width: int, prec: int = 2) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{prec}f}"


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(stem: str) -> ModuleType:
    """``examples/<stem>.py`` as a module, loaded once per process under one name
    (examples/ is not a package): the models the README, the guide, the tests and the
    benchmarks share.

    >>> example("moe_gpt").Config().experts
    4
    """
    name = f"shardwise_example_{stem}"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{stem}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # its dataclasses look their module up here
        spec.loader.exec_module(mod)
    return mod


def example_gpt() -> ModuleType:
    """``examples/gpt.py`` (:func:`example`).

    >>> example_gpt().Config().dim
    32
    """
    return example("gpt")


def launch_flags(p: argparse.ArgumentParser, world: int) -> argparse.ArgumentParser:
    """Add the flags every Gloo-launched section takes: ``--world``, ``--limit-s``,
    ``--timeout-s``."""
    p.add_argument("--world", type=int, default=world, help="ranks to spawn (not torchrun)")
    p.add_argument("--limit-s", type=float, default=600.0,
                   help="wall-clock limit of the spawned run; stragglers are killed")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="Gloo collective timeout (a dead rank errors instead of hanging)")
    return p


def run_launched(parser: Any, rank_body: Any, options: dict[str, Any]) -> dict[str, Any] | None:
    """Rank 0's result of a section that runs ``rank_body`` on ``--world`` processes,
    with ``options`` (the flags of ``parser``, as ``run()`` takes them): Gloo, or NCCL
    where the section has a ``--device`` flag set to ``cuda``."""
    args = options_of(parser(), options)
    backend = "nccl" if getattr(args, "device", "cpu") == "cuda" else "gloo"
    res: dict[str, Any] | None = launch(rank_body, args, args.world, limit_s=args.limit_s,
                                        timeout_s=args.timeout_s, backend=backend)
    return res


def main_launched(parser: Any, run: Any, tables: Any, argv: list[str] | None) -> int:
    """``python -m benchmarks.<section>``: run, write the JSON to ``--out``, print."""
    args = parser().parse_args(argv)
    res = run(**{k: v for k, v in vars(args).items() if k != "out"})
    if res is not None:
        path = write_json(args.out, res)
        print("\n".join(tables(res)) + f"\nJSON: {path}")
    return 0
