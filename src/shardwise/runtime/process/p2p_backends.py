"""Where point-to-point transfers run: the backends they take (Gloo, NCCL), the device
their messages live on, whether each stream needs a process group of its own, and a
bounded wait for an NCCL work.

Invariants:
- Only Gloo and NCCL carry transfers; NCCL needs a GPU and a torch built with it
  (:func:`check_backend` refuses the rest, naming the value and the fix).
- A message lives where the backend sends from (:func:`message_device`): the CPU on
  Gloo, this process's current GPU on NCCL.
- Streams share one group (separated by tags) only on Gloo; elsewhere each stream
  needs its own (:func:`needs_stream_groups`; ``WORLD.force_stream_groups`` asks for
  that layout on Gloo, for tests).
- An NCCL wait is bounded from its own start (:func:`poll`), never from the work's
  enqueue.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from shardwise.runtime.process.world import WORLD
from shardwise.sharding.errors import ShardingError

__all__ = ["check_backend", "message_device", "needs_stream_groups", "poll"]

_BACKENDS = ("gloo", "nccl")
_POLL_MAX_S = 2e-4        # the longest sleep between two polls of an NCCL work (torch's
                          # own blocking wait sleeps 1 ms: a microbatch would wait for it)


def check_backend(what: str, pg: Any = None) -> str:
    """The backend of ``pg`` (default: the world's) when point-to-point transfers can
    run on it; else a :class:`ShardingError` naming it and the fix. ``what`` names the
    caller (e.g. "The pipeline transport between processes")."""
    backend = str(dist.get_backend(pg))
    if backend not in _BACKENDS:
        raise ShardingError(
            f"{what} runs on Gloo or NCCL; this run's backend is {backend!r}. Initialize "
            "with backend='gloo' (CPU) or 'nccl' (one GPU per process), or keep every "
            "stage in one process (the simulated mesh).")
    if backend == "nccl" and not dist.is_nccl_available():
        raise ShardingError(
            f"{what}: this run's backend is 'nccl' but this torch build has no NCCL "
            f"(torch {torch.__version__}, torch.distributed.is_nccl_available() is False). "
            "Install a CUDA build of torch with NCCL, or initialize with backend='gloo'.")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ShardingError(
            f"{what}: this run's backend is 'nccl', whose messages live on this process's "
            "GPU, but torch.cuda.is_available() is False here. Run where every process "
            "has a GPU (torchrun --nproc-per-node <GPUs>), or initialize with "
            "backend='gloo'.")
    return backend


def message_device(pg: Any = None) -> torch.device:
    """Where the messages over ``pg`` (default: the world's group) live: this process's
    current GPU on NCCL (which sends device memory only), the CPU on Gloo. The agreement's
    header-only messages live there too.

    >>> message_device()  # doctest: +SKIP
    device(type='cpu')
    """
    if dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def needs_stream_groups(pg: Any = None) -> bool:
    """Whether every stream needs its own process group: on NCCL (tags do not separate
    streams: a pair's transfers match in posting order, and two opposite directions on
    one communicator can deadlock), or where the test hook
    ``WORLD.force_stream_groups`` (``SHARDWISE_P2P_STREAM_GROUPS=1``) asks for NCCL's
    layout on Gloo. Gloo keeps one group and separates streams by tag (cheaper).

    >>> needs_stream_groups()  # doctest: +SKIP
    False
    """
    return WORLD.force_stream_groups or dist.get_backend(pg) != "gloo"


def poll(work: Any, deadline: float) -> None:
    """Wait for an NCCL work until ``deadline`` (monotonic), polling it from the host.

    Why not ``work.wait(timeout=...)`` (torch 2.13, ``ProcessGroupNCCL::WorkNCCL::wait``):
    with a timeout it does block the host, polling ``isCompleted()``, but it measures
    the timeout from the work's ENQUEUE (``workStartTime_``), not from the wait; a
    receive pre-posted in the previous step would time out at once after a long pause
    between steps. On expiry it also aborts the communicator. So the host polls
    ``is_completed()`` against a deadline counted from this wait's start (as Gloo's
    wait counts it), then ``wait()`` without a timeout only orders the current CUDA
    stream after the transfer (and raises the work's error, e.g. a peer's NCCL error)."""
    pause = 0.0
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise RuntimeError("point-to-point wait timed out (polled from the host)")
        time.sleep(pause)
        pause = min(2 * pause + 1e-5, _POLL_MAX_S)
    work.wait()
