"""Run under ``torchrun --nproc-per-node 4``: a 2x2 (dp, tp) mesh whose rank 2 stalls
before the dp all_reduce. Rank 0 (dp {0, 2}) and rank 3 (tp {2, 3}) wait for it
directly; rank 1 (tp {0, 1}) waits for rank 0, a bystander: the witnesses must fail
first, so that torchrun's "Root Cause" is not rank 1 (issue 24), although rank 1
times out first (ranks 0 and 3 start waiting 1.5 s late)."""

from __future__ import annotations

import os
import time

import torch

import shardwise as sw
import shardwise.distributed as sd
from shardwise import DeviceMesh, PlacementMapping

sd.initialize("gloo", timeout_s=3.0)
mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
p = sw.tensor(torch.ones(4, 2), sharding=PlacementMapping(mesh, [sw.Partial(), sw.Partial()]))
sw.all_reduce(p, reduce_axes="dp")
sw.all_reduce(p, reduce_axes="tp")
rank = int(os.environ["RANK"])
if rank == 2:
    time.sleep(60)  # stalled; torchrun stops it once another rank fails
if rank == 0:
    time.sleep(1.5)  # the witnesses start waiting late: rank 1 times out first
sw.all_reduce(p, reduce_axes="dp")
if rank == 3:
    time.sleep(1.5)
sw.all_reduce(p, reduce_axes="tp")
