"""Gloo benchmark: shardwise reshards beside raw torch.distributed and PyTorch DTensor.

Runs ``--world`` Gloo ranks on 127.0.0.1 (spawned here with a free port and a
wall-clock limit, or launched by torchrun) and, for a ``--size`` x ``--size``
float32 tensor on a 1-D mesh over the ranks, times each transition three ways:
the shardwise op, the raw torch.distributed call(s) producing the same local
result, and DTensor ``redistribute``. It also times the same ops on an 8x8
tensor (per-op overhead) and pairs of Gloo primitives that give the same
result (``primitive_choice``). Every measured result is checked once against
the raw result and a reference before it is timed.

Timing: barrier before each call, ``time.perf_counter`` around it, the max over
ranks per iteration, the median over ``--repeat`` iterations after warm-up; the
calls compared in one row are interleaved, so load drift hits them alike.
Each rank runs ``torch.set_num_threads(1)``.

    python -m benchmarks.gloo                        # from the repo root: 4 ranks, 4096^2
    python -m benchmarks.gloo --size 512 --repeat 3
    torchrun --standalone --nproc-per-node 4 -m benchmarks.gloo
    (``shardwise bench`` and ``python -m benchmarks`` run it in the whole suite.)

Writes JSON (default benchmarks/results/gloo.json) and prints tables.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
from torch.distributed.tensor import Partial as DPartial

import shardwise as sw
from benchmarks.common import dist_time, launch, launch_flags, options_of, ratio, write_json
from benchmarks.report import gloo_tables
from shardwise.runtime import position
from shardwise.sharding import DeviceMesh, Partial, PlacementMapping, Replicated, Sharded

__all__ = ["main", "parser", "report", "run"]

Fn = Callable[[], torch.Tensor]

NOTES = [
    "raw = the same local result from plain torch.distributed in a fresh output buffer "
    "(shardwise never mutates inputs and returns fresh buffers); raw_bare = the bare "
    "collective on preallocated buffers.",
    "DTensor on CPU/Gloo: Shard(i)->Shard(j) falls back to all_gather + chunk + contiguous "
    "(torch.distributed.tensor._collective_utils.shard_dim_alltoall); ppermute has no "
    "DTensor equivalent (null).",
    "Gloo's reduce_scatter_tensor / reduce_scatter_single is clone(input) + allreduce + copy "
    "of this rank's piece (ProcessGroupGloo::reduce_scatter_tensor_coalesced), so it moves "
    "as many bytes as all_reduce.",
    "Ranks share the machine's cores (see cpu_count): timings include scheduling noise; "
    "compare ratios within one run.",
]


@dataclass
class Case:
    """One transition: each callable returns this rank's local result."""

    name: str
    expected: Fn                 # reference local result (computed without communication)
    exact: bool                  # pure data movement: results must be bit-equal
    sw: Fn
    raw: Fn
    raw_desc: str
    dt: Fn | None = None
    dt_desc: str | None = None
    bare: Fn | None = None       # the bare collective on preallocated buffers
    bare_desc: str | None = None
    bare_checked: bool = False   # the bare call's result is the step's result (checked)


@dataclass
class Option:
    name: str
    fn: Fn
    full: bool = True           # gives the step's full local result (else: for reference)
    destructive: bool = False   # overwrites its input (shardwise never mutates inputs)

    @property
    def eligible(self) -> bool:
        return self.full and not self.destructive


@dataclass
class Choice:
    """Gloo primitives that give the same local result for one planner step."""

    step: str
    exact: bool
    options: list[Option]


def _randn(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, n, generator=torch.Generator().manual_seed(seed))


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-5)


class Setup:
    """Inputs of one size on this rank, in shardwise, raw and DTensor form."""

    def __init__(self, n: int) -> None:
        self.w = w = dist.get_world_size()
        self.r = r = dist.get_rank()
        if n % w:
            raise ValueError(f"--size {n} must be divisible by the world size {w}")
        self.n, self.rows, self.cols = n, n // w, n // w
        self.x = _randn(n, 0)                     # the global value (same on every rank)
        self.local = self.x.narrow(0, r * self.rows, self.rows)   # this rank's Shard(0) block
        self.partial = _randn(n, 1000 + r)        # this rank's Partial(sum) term
        self.mesh = mesh = DeviceMesh.cpu((w,), ("x",))
        self.pm = lambda p: PlacementMapping(mesh, (p,))
        self.s0_spec = self.pm(Sharded(0))

        def mine(t: torch.Tensor, p: Any) -> Any:
            return sw.from_local([t if k == r else None for k in range(w)], self.pm(p),
                                 shape=(n, n))

        self.s0 = mine(self.local, Sharded(0))
        self.part = mine(self.partial, Partial())
        self.repl = mine(self.x, Replicated())
        self.ring = [(i, (i + 1) % w) for i in range(w)]
        self.dmesh = dmesh = init_device_mesh("cpu", (w,))
        self.d_s0 = DTensor.from_local(self.local, dmesh, [Shard(0)], run_check=False)
        self.d_part = DTensor.from_local(self.partial, dmesh, [DPartial()], run_check=False)
        self.d_rep = DTensor.from_local(self.x, dmesh, [Replicate()], run_check=False)
        # preallocated buffers for the bare calls
        self.packed = self.pack(self.local)
        self.a2a_out = torch.empty(n, self.cols)
        self.scratch = torch.zeros(n, n)  # in-place all_reduce target (zeros stay zeros)

    # --- helpers ------------------------------------------------------------------------
    def pack(self, block: torch.Tensor) -> torch.Tensor:
        """Column chunk j of this rank's row block, for rank j, contiguous: (w, rows, cols)."""
        return block.view(self.rows, self.w, self.cols).transpose(0, 1).contiguous()

    def full_sum(self) -> torch.Tensor:
        return sum((_randn(self.n, 1000 + i) for i in range(self.w)), torch.zeros(self.n, self.n))

    def dt_local(self, d: Any) -> torch.Tensor:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        loc = d.to_local()
        return loc.wait() if isinstance(loc, AsyncCollectiveTensor) else loc

    # --- raw torch.distributed --------------------------------------------------------
    def raw_all_gather(self) -> torch.Tensor:
        out = torch.empty(self.n, self.n)
        dist.all_gather_single(out, self.local)
        return out

    def raw_all_gather_list_cat(self) -> torch.Tensor:
        outs = [torch.empty(self.rows, self.n) for _ in range(self.w)]
        dist.all_gather(outs, self.local)
        return torch.cat(outs)

    def raw_all_gather_list(self) -> torch.Tensor:
        outs = [torch.empty(self.rows, self.n) for _ in range(self.w)]
        dist.all_gather(outs, self.local)
        return outs[self.r]  # no cat: only the gather (result not the full value)

    def raw_all_to_all(self) -> torch.Tensor:
        inp = self.pack(self.local)
        out = torch.empty(self.n, self.cols)  # block i (rows of rank i) arrives in place:
        dist.all_to_all_single(out, inp)      # the unpack is a view
        return out

    def raw_all_to_all_bare(self) -> torch.Tensor:
        dist.all_to_all_single(self.a2a_out, self.packed)
        return self.a2a_out

    def raw_a2a_via_all_gather(self) -> torch.Tensor:
        return self.raw_all_gather().narrow(1, self.r * self.cols, self.cols)

    def raw_a2a_via_all_gather_contig(self) -> torch.Tensor:
        return self.raw_all_gather().narrow(1, self.r * self.cols, self.cols).contiguous()

    def raw_all_reduce(self) -> torch.Tensor:
        out = self.partial.clone()
        dist.all_reduce(out)
        return out

    def raw_all_reduce_bare(self) -> torch.Tensor:
        dist.all_reduce(self.scratch)
        return self.scratch

    def raw_reduce_scatter(self) -> torch.Tensor:
        out = torch.empty(self.rows, self.n)
        dist.reduce_scatter_single(out, self.partial)
        return out

    def raw_rs_via_all_reduce(self) -> torch.Tensor:
        return self.raw_all_reduce().narrow(0, self.r * self.rows, self.rows)

    def raw_rs_via_all_to_all(self) -> torch.Tensor:
        out = torch.empty(self.n, self.n)
        dist.all_to_all_single(out, self.partial)
        return out.view(self.w, self.rows, self.n).sum(0)

    def raw_rs_via_all_reduce_inplace(self) -> torch.Tensor:
        dist.all_reduce(self.scratch)
        return self.scratch.narrow(0, self.r * self.rows, self.rows)

    def raw_slice(self) -> torch.Tensor:
        return self.x.narrow(0, self.r * self.rows, self.rows)

    def raw_ring(self) -> torch.Tensor:
        out = torch.empty_like(self.local)
        ops = [dist.P2POp(dist.isend, self.local, (self.r + 1) % self.w),
               dist.P2POp(dist.irecv, out, (self.r - 1) % self.w)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return out

    # --- the cases ----------------------------------------------------------------------
    def cases(self) -> list[Case]:
        r, rows, cols = self.r, self.rows, self.cols
        x, w = self.x, self.w
        R, S = Replicate, Shard
        dm = self.dmesh
        dl = self.dt_local
        summed: list[torch.Tensor] = []

        def total() -> torch.Tensor:
            if not summed:
                summed.append(self.full_sum())
            return summed[0]

        return [
            Case("Shard(0)->Replicated (all_gather)", lambda: x, True,
                 lambda: sw.all_gather(self.s0).shards[r],
                 self.raw_all_gather, "all_gather_single",
                 lambda: dl(self.d_s0.redistribute(dm, [R()])), "redistribute([Replicate()])"),
            Case("Shard(0)->Shard(1) (all_to_all)",
                 lambda: x.narrow(1, r * cols, cols), True,
                 lambda: sw.all_to_all(self.s0, 1, 0).shards[r],
                 self.raw_all_to_all, "pack + all_to_all_single (unpack is a view)",
                 lambda: dl(self.d_s0.redistribute(dm, [S(1)])),
                 "redistribute([Shard(1)]) (Gloo: all_gather + chunk)",
                 self.raw_all_to_all_bare, "all_to_all_single (prepacked)", True),
            Case("Partial->Replicated (all_reduce)", total, False,
                 lambda: sw.all_reduce(self.part).shards[r],
                 self.raw_all_reduce, "clone + all_reduce",
                 lambda: dl(self.d_part.redistribute(dm, [R()])), "redistribute([Replicate()])",
                 self.raw_all_reduce_bare, "in-place all_reduce (no clone)"),
            Case("Partial->Shard(0) (reduce_scatter)",
                 lambda: total().narrow(0, r * rows, rows), False,
                 lambda: sw.reduce_scatter(self.part, 0).shards[r],
                 self.raw_reduce_scatter, "reduce_scatter_single",
                 lambda: dl(self.d_part.redistribute(dm, [S(0)])), "redistribute([Shard(0)])"),
            Case("Replicated->Shard(0) (local slice)",
                 lambda: x.narrow(0, r * rows, rows), True,
                 lambda: sw.shard(self.repl, dim_specs=self.s0_spec).shards[r],
                 self.raw_slice, "narrow",
                 lambda: dl(self.d_rep.redistribute(dm, [S(0)])), "redistribute([Shard(0)])"),
            Case("ppermute ring (Shard(0) blocks)",
                 lambda: x.narrow(0, ((r - 1) % w) * rows, rows), True,
                 lambda: sw.ppermute(self.s0, self.ring).shards[r],
                 self.raw_ring, "batch_isend_irecv (isend + irecv)"),
        ]

    def choices(self) -> list[Choice]:
        return [
            Choice("Partial->Shard(0)", False, [
                Option("reduce_scatter_single", self.raw_reduce_scatter),
                Option("clone + all_reduce + narrow", self.raw_rs_via_all_reduce),
                Option("all_to_all_single + local sum (shardwise on CPU)",
                       self.raw_rs_via_all_to_all),
                Option("in-place all_reduce + narrow (destroys input)",
                       self.raw_rs_via_all_reduce_inplace, destructive=True),
            ]),
            Choice("Shard(0)->Replicated", True, [
                Option("all_gather_single", self.raw_all_gather),
                Option("all_gather (list) + cat", self.raw_all_gather_list_cat),
                Option("all_gather (list), no cat (partial result)", self.raw_all_gather_list,
                       full=False),
            ]),
            Choice("Shard(0)->Shard(1)", True, [
                Option("pack + all_to_all_single", self.raw_all_to_all),
                Option("all_gather_single + narrow (strided view)", self.raw_a2a_via_all_gather),
                Option("all_gather_single + narrow + contiguous",
                       self.raw_a2a_via_all_gather_contig),
            ]),
        ]


def _agree(flags: list[bool]) -> list[bool]:
    """Each flag ANDed over the ranks."""
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(v) for v in t.tolist()]


def validate_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """Run every measured callable once; raise (on every rank) if a result is wrong."""
    flags: list[bool] = []
    for c in cases:
        ref = c.expected()
        raw = c.raw()
        flags.append(_same(raw, ref, c.exact))
        # shardwise must equal raw exactly where nothing is summed; reductions may sum in
        # another order (reduce_scatter on Gloo: all_to_all + local sum), so allclose
        flags.append(_same(c.sw(), raw, c.exact))
        if c.dt is not None:
            d = c.dt()
            flags += [_same(d, ref, c.exact), torch.equal(d, raw)]
        else:
            flags += [True, True]
        if c.bare is not None and c.bare_checked:
            flags.append(torch.equal(c.bare(), raw))
        else:
            flags.append(True)
    ok = _agree(flags)
    report, bad = [], []
    for i, c in enumerate(cases):
        raw_ok, sw_eq, dt_ok, dt_eq, bare_eq = ok[5 * i: 5 * i + 5]
        report.append({"case": c.name, "raw_matches_reference": raw_ok,
                       "shardwise_equals_raw": sw_eq,  # bit-exact when exact, else allclose
                       "dtensor_matches_reference": dt_ok if c.dt else None,
                       "dtensor_equals_raw": dt_eq if c.dt else None,
                       "bare_equals_raw": bare_eq if c.bare_checked
                       else None})
        for what, good in (("raw vs reference", raw_ok), ("shardwise vs raw", sw_eq),
                           ("DTensor vs reference", dt_ok), ("bare vs raw", bare_eq)):
            if not good:
                bad.append(f"{c.name}: {what}")
    if bad:
        raise AssertionError("wrong results (checked before timing): " + "; ".join(bad))
    return report


def validate_choices(setup: Setup, choices: list[Choice]) -> None:
    """Every option of a step gives the first option's result (once, before timing)."""
    setup.scratch.copy_(setup.partial)  # the in-place all_reduce reduces the real partials
    names, flags = [], []
    for ch in choices:
        first = ch.options[0].fn()
        for o in ch.options[1:]:
            got = o.fn()
            names.append(f"{ch.step}: {o.name}")
            flags.append(not o.full or _same(got, first, ch.exact))
    setup.scratch.zero_()  # timed in-place calls reduce zeros (values stay finite)
    ok = _agree(flags)
    if not all(ok):
        raise AssertionError("primitive_choice options disagree with the first option: "
                             f"{[n for n, good in zip(names, ok) if not good]}")


def time_cases(cases: list[Case], repeat: int, warmup: int, unit: str) -> list[dict[str, Any]]:
    """Times of each case (shardwise, raw, DTensor, bare raw interleaved), in ``unit``."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    rows = []
    for c in cases:
        t = dist_time({"shardwise": c.sw, "raw": c.raw, "dtensor": c.dt, "raw_bare": c.bare},
                      repeat, warmup)
        row: dict[str, Any] = {"case": c.name}
        for k, v in t.items():
            row[f"{k}_{unit}"] = v["median"] * scale if v else None
            row[f"{k}_min_{unit}"] = v["min"] * scale if v else None
        row["shardwise_over_raw"] = ratio(row[f"shardwise_{unit}"], row[f"raw_{unit}"])
        row["shardwise_over_raw_bare"] = ratio(row[f"shardwise_{unit}"], row[f"raw_bare_{unit}"])
        row["dtensor_over_shardwise"] = ratio(row[f"dtensor_{unit}"], row[f"shardwise_{unit}"])
        row.update(raw_desc=c.raw_desc, raw_bare_desc=c.bare_desc, dtensor_desc=c.dt_desc)
        rows.append(row)
    return rows


# --- the cost of the default collective agreement (issue 13) --------------------------------
def agreement_overhead(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time shardwise's all_reduce (Partial -> Replicated) with the collective agreement
    on (the default) and off, on an 8x8 and a ``--size`` x ``--size`` float32 tensor.

    Paired: each iteration times one call of each, adjacent, the order alternating,
    each behind a barrier and as the max over ranks; ``overhead`` is the median over
    iterations of on / off - 1 (robust to the load drifting on a shared machine), and
    ``overhead_of_medians`` the ratio of the two medians. Off is a measurement switch
    only (``runtime.world.WORLD.agreement``; every rank flips it alike). The large case
    takes ``9 * --repeat`` pairs: adjacent calls differ by ~10% on a shared machine, so
    a 1% target needs about a hundred pairs to be resolved."""
    import statistics
    import time

    from shardwise.runtime.process.world import WORLD

    w, r = dist.get_world_size(), dist.get_rank()
    mesh = DeviceMesh.cpu((w,), ("x",))
    rows = []
    for n, repeat, unit in ((args.small, args.small_repeat, "us"),
                            (args.size, 9 * args.repeat, "ms")):
        part = sw.from_local([_randn(n, 1000 + r) if k == r else None for k in range(w)],
                             PlacementMapping(mesh, (Partial(),)), shape=(n, n))

        def call(on: bool, part: Any = part) -> torch.Tensor:
            WORLD.agreement = on
            # issued where a model issues it (a row-parallel layer's output), so the
            # fingerprint carries a program position as in training (issue 24)
            with position.at(_SITE), position.issuing("output"):
                out: torch.Tensor = sw.all_reduce(part).shards[r]
            return out

        times = torch.empty(2, repeat, dtype=torch.float64)
        try:
            a, b = call(True), call(False)
            if not _agree([torch.allclose(a, b, rtol=1e-5, atol=1e-5)])[0]:
                raise AssertionError("all_reduce with and without the agreement differ")
            for i in range(-3, repeat):  # 3 warm-up pairs
                for on in ((True, False) if i % 2 else (False, True)):
                    dist.barrier()
                    t0 = time.perf_counter()
                    call(on)
                    if i >= 0:
                        times[0 if on else 1, i] = time.perf_counter() - t0
        finally:
            WORLD.agreement = True
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        on_t, off_t = times[0].tolist(), times[1].tolist()
        scale = {"ms": 1e3, "us": 1e6}[unit]
        rows.append({
            "case": f"all_reduce {n}x{n} float32 (Partial->Replicated), {w} ranks, program "
                    "position included", "unit": unit,
            "world": w,
            "on": statistics.median(on_t) * scale, "off": statistics.median(off_t) * scale,
            "on_min": min(on_t) * scale, "off_min": min(off_t) * scale,
            "overhead": statistics.median(on_i / off_i for on_i, off_i in zip(on_t, off_t))
            - 1.0,
            "overhead_of_medians": statistics.median(on_t) / statistics.median(off_t) - 1.0,
            "overhead_min": min(on_t) / min(off_t) - 1.0, "repeat": repeat,
            "limit": 0.05 if n == args.small else 0.01})
    return rows


_SITE = position.site("layers.0.mlp.fc2", "RowwiseParallel linear")


def rank_body(args: argparse.Namespace) -> dict[str, Any]:
    # DTensor logs once that Gloo has no alltoall and it falls back to all_gather + chunk.
    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    w = dist.get_world_size()
    small_n = -(-args.small // w) * w  # divisible by the world size
    big = Setup(args.size)
    big_cases = big.cases()
    validation = validate_cases(big_cases)
    choices = big.choices() if args.choices else []
    if choices:
        validate_choices(big, choices)
    large = time_cases(big_cases, args.repeat, args.warmup, "ms")
    picks = []
    for ch in choices:
        t = dist_time({o.name: o.fn for o in ch.options}, args.repeat, args.warmup)
        opts: list[dict[str, Any]] = []
        for o in ch.options:
            got = t[o.name]
            assert got is not None
            opts.append({"option": o.name, "ms": got["median"] * 1e3, "min_ms": got["min"] * 1e3,
                         "eligible": o.eligible, "full_result": o.full,
                         "destroys_input": o.destructive})
        best = min((o for o in opts if o["eligible"]), key=lambda o: o["ms"])
        for row in opts:
            row["x_fastest"] = row["ms"] / best["ms"]
        picks.append({"step": ch.step, "options": opts, "fastest": best["option"]})
    del big, big_cases, choices
    small = Setup(small_n)
    small_cases = small.cases()
    small_validation = validate_cases(small_cases)
    small_rows = time_cases(small_cases, args.small_repeat, 5, "us")
    overhead = agreement_overhead(args)
    n = args.size
    return {
        "benchmark": "gloo",
        "agreement_overhead": overhead,
        "meta": {
            "torch": torch.__version__, "backend": "gloo", "world_size": w,
            "launcher": "torch.multiprocessing spawn" if args.spawned else "torchrun",
            "tensor": [n, n], "dtype": "float32", "bytes": n * n * 4,
            "shard_bytes_per_rank": n * n * 4 // w,
            "threads_per_rank": torch.get_num_threads(),
            "threads_note": "torch.set_num_threads(1) and OMP_NUM_THREADS=1 in each rank",
            "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "repeat": args.repeat, "warmup": args.warmup,
            "small_shape": [small_n, small_n], "small_repeat": args.small_repeat,
            "timing": "barrier before each call; perf_counter around it; max over ranks per "
                      "iteration (all_reduce MAX); median over iterations after warm-up",
            "raw_note": "raw calls allocate their output per call, as shardwise does; "
                        "raw_bare reuses preallocated buffers",
        },
        "notes": NOTES,
        "large": large, "small": small_rows,
        "primitive_choice": picks,
        "validation": {"large": validation, "small": small_validation},
    }


def report(res: dict[str, Any], out: str) -> None:
    path = write_json(out, res)
    print("\n".join(gloo_tables(res)) + f"\nJSON: {path}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=4096, help="global tensor is size x size")
    p.add_argument("--repeat", type=int, default=5, help="timed iterations (large)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed calls of each before timing (large; +1 validation call)")
    p.add_argument("--small", type=int, default=8, help="size of the overhead tensor")
    p.add_argument("--small-repeat", type=int, default=200)
    launch_flags(p, world=4)
    p.add_argument("--no-choices", dest="choices", action="store_false",
                   help="skip the primitive_choice comparison")
    p.add_argument("--out", default="benchmarks/results/gloo.json")
    return p


def run(**options: Any) -> dict[str, Any] | None:
    """The Gloo suite with ``options`` (the command-line flags, as keywords); rank 0's
    result, or None on the other ranks under torchrun."""
    args = options_of(parser(), options)
    args.spawned = "RANK" not in os.environ
    res: dict[str, Any] | None = launch(rank_body, args, args.world, limit_s=args.limit_s,
                                        timeout_s=args.timeout_s)
    cores = os.cpu_count() or 1
    if res is not None and args.spawned and 2 <= cores < args.world:
        # The agreement's cost again with one rank per core: oversubscribed ranks time
        # the OS scheduler (4 ranks on 2 cores: a tiny all_reduce takes 1.5-7 ms and
        # adjacent calls differ by tens of percent), not the check.
        res["agreement_overhead_oversubscribed"] = res["agreement_overhead"]
        res["agreement_overhead"] = launch(agreement_body, args, cores,
                                           limit_s=args.limit_s, timeout_s=args.timeout_s)
    return res


def agreement_body(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return agreement_overhead(args)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    res = run(**{k: v for k, v in vars(args).items() if k != "out"})
    if res is not None:
        report(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
