"""Context-parallel attention at cp = 1, 2, 4: ring and all-to-all beside full attention
and beside the all_gather-the-sequence baseline, on the simulated mesh and on Gloo.

One causal attention (q, k, v of ``batch x heads x seq x dim`` float32, MHA), forward
and backward, on a ``cp`` mesh axis:

- ``full``: torch's ``F.scaled_dot_product_attention`` on one device, the whole sequence;
- ``ring`` / ``alltoall``: ``with context_parallel(mesh, method=...)`` on q, k, v sharded
  over ``cp`` by ``cp.shard`` (head-tail order);
- ``all_gather``: the same sharded q, k, v outside the region: shardwise's own rule
  gathers k and v over ``cp`` and each device attends its queries to the whole sequence.

Beside each, the bytes ``CommCounter`` saw per device in the forward and the closed form
(per rank per forward, ``N`` tokens, ``h`` = heads x dim, float32): ring
``2 N h_kv (cp-1)/cp`` (cp - 1 exchanges of the KV block), all-to-all
``4 N h (cp-1) / cp^2`` (q, k, v and the output: of each block of ``N h / cp``, the
``(cp-1)/cp`` that leaves the device), all_gather ``3 N h (cp-1)/cp`` (for causal attention
shardwise's rule gathers q as well as k and v); none at cp = 1.
Timing: medians of interleaved runs (simulated: process CPU time of one process
running every device, one torch thread; Gloo: the max over ``cp`` ranks of wall time,
one thread each).

    python -m benchmarks.attention               # both, at the full preset's size
    python -m benchmarks.attention --quick --no-gloo
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["closed_form", "main", "run", "tables"]

METHODS = ("ring", "alltoall")


def closed_form(case: str, tokens: int, h: int, cp: int, itemsize: int = 4) -> int:
    """Bytes per rank per forward of ``case`` (module doc).

    >>> closed_form("ring", 1024, 256, 4), closed_form("alltoall", 1024, 256, 4)
    (1572864, 786432)
    """
    if cp == 1:
        return 0
    if case == "alltoall":
        return 4 * tokens * h * (cp - 1) // (cp * cp) * itemsize
    if case == "ring":
        return 2 * tokens * h * (cp - 1) // cp * itemsize
    if case == "all_gather":
        return 3 * tokens * h * (cp - 1) // cp * itemsize
    return 0


def _inputs(batch: int, heads: int, seq: int, dim: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, seq, dim, generator=gen) for _ in range(3)]


def _cases(mesh: Any, qkv: list[torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The step of each case (forward + backward) and its forward's CommCounter."""
    from shardwise.debug import CommCounter
    from shardwise.parallel import context_parallel

    q, k, v = (t.clone().requires_grad_() for t in qkv)

    def plain() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    steps: dict[str, Any] = {"full": plain}
    comm: dict[str, Any] = {}
    for method in (*METHODS, "all_gather"):
        region = context_parallel(mesh, "cp", method="ring" if method == "all_gather"
                                  else method)
        held = [region.shard(t, 2).detach().requires_grad_() for t in qkv]
        inside = method != "all_gather"

        def step(held: list[Any] = held, region: Any = region, inside: bool = inside,
                 counter: Any = None) -> None:
            if inside:
                region.__enter__()
            try:
                with counter if counter is not None else contextlib.nullcontext():
                    y = F.scaled_dot_product_attention(held[0], held[1], held[2],
                                                       is_causal=True)
            finally:
                if inside:
                    region.__exit__()
            y.sum().backward()

        counter = CommCounter()
        step(counter=counter)
        comm[method] = {"counts": dict(counter.counts), "bytes": sum(counter.bytes.values())}
        steps[method] = step
    return steps, comm


def _rows(times: dict[str, Any], comm: dict[str, Any], cp: int, batch: int, heads: int,
          seq: int, dim: int, key: str) -> dict[str, Any]:
    tokens, h = batch * seq, heads * dim
    out = {}
    for name, t in times.items():
        if t is None:
            continue
        row = {"ms": t[key] * 1e3, "x_full": t[key] / times["full"][key]}
        if name in comm:
            row.update(counts=comm[name]["counts"], bytes=comm[name]["bytes"],
                       closed_form=closed_form(name, tokens, h, cp))
        out[name] = row
    return out


def simulated(cp: int, batch: int, heads: int, seq: int, dim: int, repeat: int
              ) -> dict[str, Any]:
    """The cases on a simulated ``cp``-device mesh (one process, CPU time)."""
    from benchmarks.timing import interleave
    from shardwise import DeviceMesh

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time of one thread per device (no spinning pool)
    try:
        steps, comm = _cases(DeviceMesh.cpu(cp, "cp"), _inputs(batch, heads, seq, dim))
        times = interleave(steps, repeat, clock=time.process_time)
    finally:
        torch.set_num_threads(threads)
    return _rows(times, comm, cp, batch, heads, seq, dim, "median_s")


def rank_body(args: argparse.Namespace) -> dict[str, Any]:
    """One Gloo rank of the cases on a ``cp`` mesh over every process."""
    import torch.distributed as dist

    from benchmarks.common import dist_time
    from shardwise import DeviceMesh

    torch.set_num_threads(1)
    cp = dist.get_world_size()
    steps, comm = _cases(DeviceMesh.cpu(cp, "cp"),
                         _inputs(args.batch, args.heads, args.seq, args.dim))
    times = dist_time(steps, args.repeat)
    return _rows(times, comm, cp, args.batch, args.heads, args.seq, args.dim, "median")


def parser() -> argparse.ArgumentParser:
    from benchmarks.common import launch_flags

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--repeat", type=int, default=5)
    return launch_flags(p, 4)


def run(*, sizes: tuple[int, ...] = (1, 2, 4), gloo: bool = True, batch: int = 1,
        heads: int = 8, seq: int = 1024, dim: int = 32, repeat: int = 5,
        log: Any = None) -> dict[str, Any]:
    """Every case at each cp in ``sizes``: simulated, and (``gloo``) on cp Gloo ranks."""
    from benchmarks.common import run_launched

    say = log or (lambda msg: None)
    shape = dict(batch=batch, heads=heads, seq=seq, dim=dim)
    res: dict[str, Any] = {"case": f"causal attention, batch {batch}, {heads} heads, seq "
                                   f"{seq}, head dim {dim}, float32, forward + backward",
                           "simulated": {}, "gloo": {}}
    simulated(1, repeat=1, **shape)  # warm up the process (thread pools, first calls)
    for cp in sizes:
        say(f"attention, simulated cp={cp} ...")
        res["simulated"][str(cp)] = simulated(cp, repeat=repeat, **shape)
        if gloo and cp > 1:
            say(f"attention, {cp} Gloo ranks ...")
            res["gloo"][str(cp)] = run_launched(parser, rank_body,
                                                dict(world=cp, repeat=repeat, **shape))
    return res


def tables(res: dict[str, Any]) -> list[str]:
    lines = [f"context-parallel attention: {res['case']}",
             f"  {'runtime':9} {'cp':>2} {'case':10} {'ms':>9} {'x full':>7} "
             f"{'fwd collectives':24} {'bytes/rank':>11} {'closed form':>11}"]
    for runtime in ("simulated", "gloo"):
        for cp, rows in res.get(runtime, {}).items():
            for name, row in rows.items():
                counts = ", ".join(f"{k} {v}" for k, v in row.get("counts", {}).items())
                nbytes = row.get("bytes")
                lines.append(
                    f"  {runtime:9} {cp:>2} {name:10} {row['ms']:9.2f} {row['x_full']:7.2f} "
                    f"{counts or '-':24} {'-' if nbytes is None else nbytes:>11} "
                    f"{row.get('closed_form', '-'):>11}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.attention [--quick] [--no-gloo] [--out FILE]``."""
    from benchmarks.common import write_json

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="seq 512, 3 repeats")
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument("--out", default="bench-results/attention.json")
    args = p.parse_args(argv)
    res = run(gloo=not args.no_gloo, seq=512 if args.quick else 1024,
              repeat=3 if args.quick else 5,
              log=lambda msg: print(msg, file=sys.stderr, flush=True))
    path = write_json(args.out, res)
    print("\n".join(tables(res)) + f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
