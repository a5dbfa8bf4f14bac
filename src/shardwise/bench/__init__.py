"""shardwise benchmarks, runnable from an installed package: ``shardwise bench``.

Modules: :mod:`~shardwise.bench.suite` (the whole suite, JSON + table),
:mod:`~shardwise.bench.simulated` (simulated mesh vs copy ceiling and DTensor
LocalTensorMode), :mod:`~shardwise.bench.memory` (peak memory of replication),
:mod:`~shardwise.bench.profile` (cProfile of the 8x8 hot path),
:mod:`~shardwise.bench.gloo` (Gloo ranks vs raw torch.distributed and DTensor),
:mod:`~shardwise.bench.report` (tables, target checks). Nothing here is imported
by ``import shardwise``.
"""

from shardwise.bench.suite import PRESETS, main, run_suite

__all__ = ["PRESETS", "main", "run_suite"]
