"""Simulated-mesh benchmark (a thin wrapper of :mod:`shardwise.bench.simulated`).

Every reshard transition and collective on 4 and 8 virtual devices beside the
memory-copy ceiling and DTensor's LocalTensorMode; writes JSON (default
benchmarks/results/simulated.json) and prints a table. The whole suite (with
peak memory, the 8x8 profile and Gloo) is ``shardwise bench``.

    python benchmarks/bench_simulated.py --size 4096 --devices 4 8
"""

import sys

from shardwise.bench.simulated import main

if __name__ == "__main__":
    sys.exit(main())
