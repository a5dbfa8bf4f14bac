"""Single-process timing: interleaved cases, medians, page faults.

- Every case runs once per round, in an order that reverses every other round,
  so drift in a shared machine's load hits the cases alike; a case's time is the
  median (and min) over rounds, after ``warmup`` untimed calls of each.
- ``inner`` calls are timed together (per-call time = total / inner) for cases
  that take microseconds, where one ``perf_counter`` pair is not precise enough.
- Minor page faults (``getrusage``) are counted per call: a fresh 64 MiB buffer
  from ``mmap`` faults 16384 pages, which costs more than copying into it.
- ``clock``: wall time by default; ``time.process_time`` (this process's CPU time)
  for single-threaded cases on a shared machine, where other processes' load would
  otherwise land on whichever case was running.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Timing", "interleave", "minor_faults"]

Timing = dict[str, float]
"""``{"median_s", "min_s", "faults"}``: seconds per call and minor page faults per call."""


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleave(cases: Mapping[str, Callable[[], Any] | None], repeat: int, *, warmup: int = 1,
               inner: int = 1, clock: Callable[[], float] = time.perf_counter
               ) -> dict[str, Timing | None]:
    """Seconds per call of each case (None entries give None); see the module doc."""
    active = [(k, f) for k, f in cases.items() if f is not None]
    for _ in range(warmup):
        for _, f in active:
            f()
    times: dict[str, list[float]] = {k: [] for k, _ in active}
    faults: dict[str, int] = dict.fromkeys(times, 0)
    for i in range(repeat):
        for k, f in (active if i % 2 == 0 else active[::-1]):
            f0 = minor_faults()
            t0 = clock()
            for _ in range(inner):
                f()
            dt = clock() - t0
            faults[k] += minor_faults() - f0
            times[k].append(dt / inner)
    out: dict[str, Timing | None] = dict.fromkeys(cases)
    for k, row in times.items():
        out[k] = {"median_s": statistics.median(row), "min_s": min(row),
                  "faults": faults[k] / (repeat * inner)}
    return out
