"""Simulated-mesh suite: every reshard transition and collective on 4 and 8 virtual
devices, beside the memory-copy ceiling and DTensor's LocalTensorMode.

Inputs: a ``size x size`` float32 tensor (64 MiB at 4096) on a 1-D mesh of ``n``
virtual CPUs. Sharded inputs hold one *independent* buffer per device (as after
compute); rows marked "(views)" start from ``shardwise.tensor(x, ...)``, whose
shards are views of one buffer. Partial inputs hold ``n`` independent terms.

**Bytes that must move** (``must_move_bytes``): for each distinct output buffer
(replicas share one), the bytes of the input blocks it is made from that its
device does not already hold. S(0)->R: ``(n-1)/n`` of the tensor (one shared
buffer; the device's own block is held); S(0)->S(1): ``(n-1)/n`` (each of the
``n`` blocks holds ``1/n`` of its own rows); P->R and P->S(0): ``n-1`` tensors (the
other devices' partial terms); R->S(0): 0; ppermute: the whole tensor (every
device receives a block it does not hold; on one host that is a relabelling).

**Copy ceiling** of ``b`` bytes: the median time of ``dst.copy_(x)`` (into an
existing buffer) and of ``x.clone()`` (a fresh buffer) for the tensor, scaled by
``b / tensor bytes`` (memory-bound copies scale linearly at these sizes). Both are
timed interleaved with the cases, so ``x_copy`` and ``x_clone`` are ratios within
one run. Allocator modes: ``default`` (glibc: fresh 64 MiB buffers are mmapped and
page-fault) and ``reuse`` (:func:`shardwise.runtime.simulated.set_buffer_reuse`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

import shardwise as sw
from benchmarks.dtensor_local import LocalDTensor, unavailable
from benchmarks.timing import Timing, interleave
from shardwise.runtime import simulated as runtime
from shardwise.sharding import DeviceMesh, Partial, PlacementMapping, Replicated, Sharded

__all__ = ["CASES", "Inputs", "main", "mesh_of", "must_move_bytes", "run"]

CASES = {  # key: (description, shardwise op)
    "S(0)->R": ("Shard(0)->Replicated", "all_gather"),
    "S(0)->S(1)": ("Shard(0)->Shard(1)", "all_to_all"),
    "P->R": ("Partial->Replicated", "all_reduce"),
    "P->S(0)": ("Partial->Shard(0)", "reduce_scatter"),
    "R->S(0)": ("Replicated->Shard(0)", "shard (local slice)"),
    "ppermute": ("ppermute ring of Shard(0) blocks", "ppermute"),
    "S(0)->R (views)": ("Shard(0)->Replicated, shards are views of one buffer", "all_gather"),
    "S(0)->S(1) (views)": ("Shard(0)->Shard(1), shards are views of one buffer", "all_to_all"),
}
CEILINGS = ("copy_", "clone")


def must_move_bytes(case: str, n: int, nbytes: int) -> int:
    """See the module doc."""
    base = case.split(" ")[0]
    return {"S(0)->R": nbytes * (n - 1) // n, "S(0)->S(1)": nbytes * (n - 1) // n,
            "P->R": (n - 1) * nbytes, "P->S(0)": (n - 1) * nbytes, "R->S(0)": 0,
            "ppermute": nbytes}[base]


_MESHES: dict[int, DeviceMesh] = {}


def mesh_of(n: int) -> DeviceMesh:
    """One mesh object per size for the whole run, as a program builds its mesh once
    (an equal but distinct mesh costs ~1 us per cache lookup that compares meshes)."""
    mesh = _MESHES.get(n)
    if mesh is None:
        mesh = _MESHES[n] = DeviceMesh.cpu((n,), ("x",))
    return mesh


class Inputs:
    """The inputs of one mesh size, in shardwise form (and raw buffers for DTensor)."""

    def __init__(self, n: int, size: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.n, self.size = n, size
        self.mesh = mesh_of(n)
        self.x = x = torch.randn(size, size, generator=gen)
        self.nbytes = x.numel() * x.element_size()
        self.rows = [b.clone() for b in x.tensor_split(n, 0)]
        self.terms = [torch.randn(size, size, generator=gen) for _ in range(n)]
        self.s0 = sw.from_local(self.rows, self.pm(Sharded(0)), shape=(size, size))
        self.s0_views = sw.tensor(x, sharding=self.pm(Sharded(0)))
        self.part = sw.from_local(self.terms, self.pm(Partial()), shape=(size, size))
        self.repl = sw.tensor(x, sharding=self.pm(Replicated()))
        self.ring = [(i, (i + 1) % n) for i in range(n)]
        self.dst = torch.empty_like(x)

    def pm(self, placement: Any) -> PlacementMapping:
        return PlacementMapping(self.mesh, (placement,))

    def cases(self) -> dict[str, Callable[[], Any]]:
        s1, s0 = self.pm(Sharded(1)), self.pm(Sharded(0))
        return {
            "S(0)->R": lambda: sw.all_gather(self.s0),
            "S(0)->S(1)": lambda: sw.shard(self.s0, dim_specs=s1),
            "P->R": lambda: sw.all_reduce(self.part),
            "P->S(0)": lambda: sw.reduce_scatter(self.part, 0),
            "R->S(0)": lambda: sw.shard(self.repl, dim_specs=s0),
            "ppermute": lambda: sw.ppermute(self.s0, self.ring),
            "S(0)->R (views)": lambda: sw.all_gather(self.s0_views),
            "S(0)->S(1) (views)": lambda: sw.shard(self.s0_views, dim_specs=s1),
        }

    def ceilings(self) -> dict[str, Callable[[], Any]]:
        return {"copy_": lambda: self.dst.copy_(self.x), "clone": lambda: self.x.clone()}

    def expected(self) -> dict[str, tuple[list[torch.Tensor], bool]]:
        """Per case: each device's expected local value, and whether bit-exact."""
        n, x = self.n, self.x
        total = torch.stack(self.terms).sum(0)
        cols = list(x.tensor_split(n, 1))
        rows = list(x.tensor_split(n, 0))
        ring = [rows[(k - 1) % n] for k in range(n)]
        return {"S(0)->R": ([x] * n, True), "S(0)->S(1)": (cols, True),
                "P->R": ([total] * n, False), "P->S(0)": (list(total.tensor_split(n, 0)), False),
                "R->S(0)": (rows, True), "ppermute": (ring, True),
                "S(0)->R (views)": ([x] * n, True), "S(0)->S(1) (views)": (cols, True)}

    def dtensor(self) -> LocalDTensor:
        return LocalDTensor(self.n, self.rows, self.terms, self.x)


def _close(got: list[torch.Tensor], want: list[torch.Tensor], exact: bool) -> bool:
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        same = torch.equal(g, w) if exact else torch.allclose(g, w, rtol=1e-4, atol=1e-4)
        if g.shape != w.shape or not same:
            return False
    return True


def validate(inputs: Inputs, with_dt: bool) -> dict[str, bool]:
    """Check every shardwise (and DTensor) result once, before timing; a wrong
    shardwise result raises, a wrong DTensor result is reported."""
    want = inputs.expected()
    out = {case: _close(list(fn().shards), *want[case]) for case, fn in inputs.cases().items()}
    bad = [k for k, ok in out.items() if not ok]
    if bad:
        raise AssertionError(f"wrong simulated results (checked before timing): {bad}")
    if with_dt:
        with inputs.dtensor() as dt:
            for case, dfn in dt.cases().items():
                out[f"dtensor {case}"] = _close(dfn(), *want[case])
    return out


def _merge(rounds: list[dict[str, Timing | None]]) -> dict[str, Timing | None]:
    """Per case: median and min over rounds (each round timed every case once)."""
    out: dict[str, Timing | None] = {}
    for k in rounds[0]:
        got = [t for r in rounds if (t := r.get(k)) is not None]
        if not got:
            out[k] = None
            continue
        meds = [g["median_s"] for g in got]
        out[k] = {"median_s": statistics.median(meds), "min_s": min(g["min_s"] for g in got),
                  "faults": statistics.fmean(g["faults"] for g in got)}
    return out


def _time_large(inputs: Inputs, repeat: int, with_dt: bool) -> dict[str, Timing | None]:
    """shardwise cases and copy ceilings interleaved; DTensor (when ``with_dt``) timed
    in alternating blocks (a fake process group must exist only around its calls)."""
    ours = {**inputs.cases(), **inputs.ceilings()}
    if not with_dt:
        return interleave(ours, repeat, warmup=1)
    rounds: list[dict[str, Timing | None]] = []
    for r in range(repeat):
        got = dict(interleave(ours, 1, warmup=int(r == 0)))
        with inputs.dtensor() as dt:
            dts = interleave(dt.cases(), 1, warmup=int(r == 0))
        got.update({f"dtensor {k}": v for k, v in dts.items()})
        rounds.append(got)
    return _merge(rounds)


def _time_small(inputs: Inputs, repeat: int, inner: int, with_dt: bool
                ) -> dict[str, Timing | None]:
    """shardwise per-op times interleaved among themselves (DTensor runs between
    rounds would evict the caches they run in); DTensor's afterwards, in blocks."""
    ours: dict[str, Callable[[], Any]] = dict(inputs.cases())
    ours["torch.cat of the shards (reference)"] = lambda: torch.cat(inputs.s0.shards)
    got = dict(interleave(ours, repeat, warmup=2, inner=inner))
    if with_dt:
        rounds: list[dict[str, Timing | None]] = []
        for _ in range(3):
            with inputs.dtensor() as dt:
                rounds.append(interleave(dt.cases(), 1, warmup=2, inner=max(1, inner // 10)))
        got.update({f"dtensor {k}": v for k, v in _merge(rounds).items()})
    return got


def _rows(inputs: Inputs, t: dict[str, Timing | None], unit: float) -> list[dict[str, Any]]:
    copy_t, clone_t = t["copy_"], t["clone"]
    assert copy_t is not None and clone_t is not None
    rows = []
    for case in inputs.cases():
        got, dtt = t[case], t.get(f"dtensor {case}")
        assert got is not None
        move = must_move_bytes(case, inputs.n, inputs.nbytes)
        share = move / inputs.nbytes
        ceil_copy, ceil_clone = copy_t["median_s"] * share, clone_t["median_s"] * share
        rows.append({
            "case": case, "description": CASES[case][0], "op": CASES[case][1],
            "time": got["median_s"] * unit, "min": got["min_s"] * unit,
            "faults_per_call": got["faults"], "must_move_bytes": move,
            "copy_ceiling": ceil_copy * unit, "clone_ceiling": ceil_clone * unit,
            "x_copy": got["median_s"] / ceil_copy if move else None,
            "x_clone": got["median_s"] / ceil_clone if move else None,
            "dtensor": None if dtt is None else dtt["median_s"] * unit,
            "dtensor_over_shardwise": None if dtt is None else dtt["median_s"] / got["median_s"],
        })
    return rows


def run(devices: tuple[int, ...] = (4, 8), size: int = 4096, small: int = 8, repeat: int = 7,
        small_repeat: int = 15, small_inner: int = 200, modes: tuple[str, ...] = (
            "default", "reuse"), dtensor: bool = True) -> dict[str, Any]:
    """The simulated suite (see the module doc); returns the JSON-ready result."""
    why = unavailable() if dtensor else "skipped (--no-dtensor)"
    with_dt = why is None
    was_on = runtime.buffer_reuse()
    large: list[dict[str, Any]] = []
    validation: dict[str, dict[str, bool]] = {}
    try:
        for mode in modes:  # default first: turning reuse off keeps glibc's dynamic
            if mode == "reuse" and not runtime.set_buffer_reuse(True):  # threshold off
                large.append({"mode": mode, "skipped": "needs glibc (mallopt)"})
                continue
            for n in devices:
                inputs = Inputs(n, size)
                if mode == modes[0]:
                    validation[f"{n} devices"] = validate(inputs, with_dt)
                t = _time_large(inputs, repeat, with_dt)
                ceil = {k: {"ms": v["median_s"] * 1e3, "faults_per_call": v["faults"]}
                        for k in CEILINGS if (v := t[k]) is not None}
                large.append({"mode": mode, "devices": n, "bytes": inputs.nbytes,
                              "ceilings": ceil, "rows": _rows(inputs, t, 1e3)})
                del inputs, t
    finally:
        if not was_on:
            runtime.set_buffer_reuse(False)
    overhead = []
    for n in devices:
        inputs = Inputs(n, small)
        t = _time_small(inputs, small_repeat, small_inner, with_dt)
        rows = []
        for case, got in t.items():
            if got is None or case.startswith("dtensor"):
                continue
            dtt = t.get(f"dtensor {case}")
            rows.append({"case": case, "us": got["median_s"] * 1e6, "min_us": got["min_s"] * 1e6,
                         "dtensor_us": None if dtt is None else dtt["median_s"] * 1e6,
                         "dtensor_over_shardwise": None if dtt is None
                         else dtt["median_s"] / got["median_s"]})
        overhead.append({"devices": n, "shape": [small, small], "rows": rows})
    return {
        "tensor": [size, size], "dtype": "float32", "devices": list(devices),
        "threads": torch.get_num_threads(), "repeat": repeat, "modes": list(modes),
        "dtensor": {"available": with_dt, "why_not": why,
                    "how": "fake process group + LocalTensorMode(n): init_device_mesh('cpu', "
                           "(n,)), DTensor.from_local(LocalTensor per-rank buffers), "
                           "redistribute(mesh, [target]), to_local()"},
        "validation": validation, "large": large, "small": overhead,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.simulated``: this section alone, JSON + table."""
    from benchmarks.common import write_json
    from benchmarks.report import simulated_tables

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=4096, help="the tensor is size x size")
    p.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--modes", nargs="+", default=["default", "reuse"],
                   choices=["default", "reuse"], help="allocator modes (default first)")
    p.add_argument("--no-dtensor", action="store_true")
    p.add_argument("--out", default="benchmarks/results/simulated.json")
    args = p.parse_args(argv)
    res = run(devices=tuple(args.devices), size=args.size, repeat=args.repeat,
              modes=tuple(args.modes), dtensor=not args.no_dtensor)
    path = write_json(args.out, {"benchmark": "simulated", **res})
    print("\n".join(simulated_tables(res)) + f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
