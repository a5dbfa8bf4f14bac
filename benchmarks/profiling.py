"""Where the time of a small collective goes: cProfile of the 8x8 hot path.

Each op runs ``calls`` times under ``cProfile`` after a warm-up; the functions
with the most own time (``tottime``) are reported per op call. Profiling slows
Python code several-fold, so compare the shares, not the absolute microseconds
(the suite's per-op table has the unprofiled times).
"""

from __future__ import annotations

import cProfile
import os
import pstats
from collections.abc import Callable
from typing import Any

__all__ = ["profile_calls", "profile_small", "where"]


def where(key: tuple[str, int, str]) -> str:
    """``file:line(function)`` with the path shortened to the package (or ``~`` for builtins)."""
    path, line, func = key
    if path == "~":
        return func
    parts = path.replace(os.sep, "/").split("/")
    for anchor in ("shardwise", "torch"):
        if anchor in parts:
            path = "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
            break
    else:
        path = parts[-1]
    return f"{path}:{line}({func})"


def profile_calls(fn: Callable[[], Any], calls: int, top: int, warmup: int | None = None,
                  timer: Callable[[], float] | None = None) -> dict[str, Any]:
    """cProfile of ``calls`` calls of ``fn`` (after ``warmup``, default a tenth of them,
    at least 10), in ``timer``'s time (default wall time): per call the profiled
    microseconds and function calls, and the ``top`` functions by own time."""
    for _ in range(max(10, calls // 10) if warmup is None else warmup):
        fn()
    prof = cProfile.Profile() if timer is None else cProfile.Profile(timer)
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    rows = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return {
        "calls": calls,
        "profiled_us_per_op": stats.total_tt / calls * 1e6,  # type: ignore[attr-defined]
        "functions_per_op": sum(v[1] for v in raw.values()) / calls,
        "top": [{"function": where(k), "ncalls_per_op": v[1] / calls,
                 "tottime_us": v[2] / calls * 1e6, "cumtime_us": v[3] / calls * 1e6}
                for k, v in rows],
    }


def profile_small(n: int = 8, size: int = 8, calls: int = 2000, top: int = 8
                  ) -> dict[str, Any]:
    """cProfile of each simulated collective on an ``size x size`` tensor, ``n`` devices."""
    from benchmarks.simulated import Inputs

    inputs = Inputs(n, size)
    cases = inputs.cases()
    ops = ("S(0)->R", "S(0)->S(1)", "P->R", "P->S(0)", "R->S(0)", "ppermute")
    return {"devices": n, "shape": [size, size], "sort": "tottime",
            "ops": {op: profile_calls(cases[op], calls, top) for op in ops}}
