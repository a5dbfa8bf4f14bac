"""A tour of shardwise that runs unchanged on a simulated mesh and under torchrun.

    python examples/tour.py                              # 4 virtual CPU devices
    torchrun --nproc-per-node 4 examples/tour.py         # 4 processes, Gloo
    torchrun --nproc-per-node 4 examples/tour.py --device cuda   # 4 GPUs, NCCL
    python examples/tour.py --device cuda                # 4 virtual devices on one GPU

Every process checks the same global values; process 0 prints.
"""

from __future__ import annotations

import argparse

import torch

import shardwise as sw
from shardwise import Partial, PlacementMapping, Replicated, Sharded
from shardwise.distributed import maybe_initialize, process_count, process_index, shutdown


def say(*args: object) -> None:
    if process_index() == 0:
        print(*args, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A tour of shardwise.")
    p.add_argument("--device", default="cpu", help="cpu (Gloo under torchrun) or cuda "
                   "(NCCL, one GPU per process; in one process the mesh on one GPU)")
    args = p.parse_args(argv)
    multi = maybe_initialize(backend="gloo" if args.device == "cpu" else "nccl")
    runtime = f"torch.distributed, {process_count()} processes" if multi else "simulated"
    say(f"runtime: {runtime}")
    mesh = sw.init_device_mesh(args.device, (2, 2), ("dp", "tp"),
                               devices_per_gpu=None if multi else 4)
    # this process's data: on the CPU, or on its GPU (LOCAL_RANK's under torchrun; in one
    # process GPU 0, where the four virtual devices are)
    dev = torch.device("cpu") if args.device == "cpu" else torch.device(
        args.device, torch.cuda.current_device())
    x = torch.arange(8 * 6, dtype=torch.float32, device=dev).reshape(8, 6)

    t = sw.shard(x, mesh, ["dp", "tp"])                      # local slices, no communication
    say("x      ", t)
    y = sw.all_to_all(t, split_axis=0, concat_axis=1)          # tp moves from dim 1 to dim 0
    say("a2a    ", y, "\n" + str(sw.plan(t, y.dist_layout)))
    z = sw.all_gather(y)
    say("gather ", z)
    assert torch.equal(z.to_torch(), x)

    p = sw.tensor(x, sharding=PlacementMapping(mesh, [Partial(), Replicated()]))
    r = sw.reduce_scatter(p, 0, reduce_axes="dp")              # Partial -> Sharded: one step
    say("rs     ", r, "\n" + str(sw.plan(p, r.dist_layout)))
    assert torch.equal(r.to_torch(), x)

    w = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0), Sharded(1)]),
                  requires_grad=True)
    loss = (sw.all_gather(w).to_torch() ** 2).sum()
    loss.backward()                                            # gradient in w's layout
    assert w.grad is not None and torch.allclose(w.grad.to_torch(), 2 * x)
    say("grad   ", w.grad)
    say("all checks passed")
    if multi:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
