"""The shardwise benchmark suite (repository only; not part of the installed package).

Run it from the repository root with ``python -m benchmarks`` (the same options
as ``shardwise bench``, which runs this package when it finds the repository's
``benchmarks/`` folder beside the installed sources or above the current folder).

Modules: :mod:`~benchmarks.suite` (the whole suite, JSON + table),
:mod:`~benchmarks.simulated` (simulated mesh vs copy ceiling and DTensor
LocalTensorMode), :mod:`~benchmarks.memory` (peak memory of replication),
:mod:`~benchmarks.profiling` (cProfile of the 8x8 hot path),
:mod:`~benchmarks.gloo` (Gloo ranks vs raw torch.distributed and DTensor),
:mod:`~benchmarks.dispatch` (per-op overhead on Gloo ranks vs DTensor and
:mod:`~benchmarks.floor`, a minimal wrapper subclass),
:mod:`~benchmarks.report` (tables, target checks). Each section also runs alone:
``python -m benchmarks.simulated``, ``python -m benchmarks.gloo``.
"""

from benchmarks.suite import PRESETS, main, run_suite

__all__ = ["PRESETS", "main", "run_suite"]
