"""Gloo benchmark (a thin wrapper of :mod:`shardwise.bench.gloo`).

shardwise reshards on Gloo ranks beside raw torch.distributed and DTensor; writes
JSON (default benchmarks/results/gloo.json) and prints tables.

    python benchmarks/bench_gloo.py                       # 4 ranks, 4096 x 4096
    python benchmarks/bench_gloo.py --size 512 --repeat 3
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_gloo.py
"""

import sys

from shardwise.bench.gloo import main

if __name__ == "__main__":
    sys.exit(main())
