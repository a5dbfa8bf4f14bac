"""A program for the launch tests: builds a sharded tensor on a 2-device mesh, with
``--init`` after ``maybe_initialize()`` and without it otherwise."""

from __future__ import annotations

import sys

import torch

import shardwise as sw
import shardwise.distributed as sd
from shardwise import DeviceMesh, PlacementMapping, Sharded

if __name__ == "__main__":
    if "--init" in sys.argv:
        sd.maybe_initialize(timeout_s=30)
    mesh = DeviceMesh.cpu((2,), ("x",))
    t = sw.tensor(torch.arange(4.0), sharding=PlacementMapping(mesh, [Sharded(0)]))
    held = [k for k, s in enumerate(t.shards) if s is not None]
    one = sw.tensor(torch.ones(()), sharding=PlacementMapping(mesh, [sw.Replicated()]))
    total = sw.all_reduce(one)  # psum of a replicated 1: the number of devices
    print(f"process {sd.process_index()} holds {held}; psum {float(total.to_torch())}")
    # every process done before any tears down (rank 0 hosts the rendezvous store; a
    # rare SIGABRT at teardown was seen once in CI without this)
    sd.barrier("done")
    sd.shutdown()
