"""Run by ``test_multinode.py`` under two torchrun launches (2 nodes x 2 processes):
a 2x2 mesh (node x local) over both, then two faults every process must see as a
CollectiveError within the timeout. Each process prints one ``OK`` line per check;
it exits 1 on any unexpected outcome."""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import time

import torch

import shardwise as sw
import shardwise.distributed as sd
from shardwise import DeviceMesh, Partial, PlacementMapping, Sharded

TIMEOUT_S = 5.0


def expect(fn, *needles: str) -> str:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        fn()
    except sd.CollectiveError as err:
        took = time.monotonic() - start
        text = str(err)
        if took > TIMEOUT_S + 4 or not all(n in text for n in needles):
            raise AssertionError(f"after {took:.1f} s, needles {needles}: {text}") from err
        return f"{took:.1f}s"
    raise AssertionError(f"no CollectiveError (needles {needles})")


def main() -> int:
    # a worker still running after a minute prints every thread's stack and exits 1,
    # so a hang (ours or the launcher's) shows where it waits instead of a bare timeout
    faulthandler.dump_traceback_later(60, exit=True)
    # No process calls shutdown(): a group left to finalization can abort the process.
    # atexit runs hooks last-in first-out, so this one runs after initialize()'s own
    atexit.register(lambda: print(f"OK rank {os.environ['RANK']}: runtime shut down "
                                  f"before exit ({not sd.is_initialized()})", flush=True))
    sd.initialize("gloo", timeout_s=TIMEOUT_S)
    r, n = sd.process_index(), sd.process_count()
    assert n == 4, n
    mesh = DeviceMesh.cpu((2, 2), ("node", "local"))
    x = torch.arange(64.0).reshape(8, 8)
    t = sw.shard(x, mesh, ["node", "local"])
    assert torch.equal(sw.all_gather(t).to_torch(), x)             # across the nodes
    print(f"OK rank {r}: 2x2 mesh over 2 nodes, all_gather exact", flush=True)
    # 1. the last process reduces by max, the others by sum: all four raise
    p = sw.tensor(x, sharding=PlacementMapping(mesh, [Partial(), Partial()]))
    took = expect(lambda: sw.all_reduce(p, reduce_op="max" if r == 3 else "sum"), "reduce op")
    print(f"OK rank {r}: mismatch raised in {took}", flush=True)
    # 2. process 3 (node 1) skips a gather over "node" and stays alive: its partner on
    #    node 0 (process 1) raises in time, naming it; processes 0 and 2 gather fine.
    col = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), Sharded(1)]))
    sw.all_gather(col, 0)
    if r == 3:
        time.sleep(TIMEOUT_S + 5)
    elif r == 1:
        took = expect(lambda: sw.all_gather(col, 0), "all_gather", "[3] did not arrive")
        print(f"OK rank {r}: absent peer on the other node named in {took}", flush=True)
    else:
        out = sw.all_gather(col, 0)
        assert torch.equal(out.shards[r], x[:, 4 * (r % 2): 4 * (r % 2) + 4])
        print(f"OK rank {r}: its own gather unaffected", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
