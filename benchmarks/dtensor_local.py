"""PyTorch DTensor's single-process simulation (``LocalTensorMode``) of the transitions.

How it runs (as torch's own tests do): a fake default process group
(``init_process_group("fake", store=FakeStore(), rank=0, world_size=n)``), then
under ``LocalTensorMode(n)`` a 1-D ``init_device_mesh("cpu", (n,))``, DTensors
made with ``DTensor.from_local`` of a ``LocalTensor`` holding one buffer per rank
(the same buffers the shardwise inputs hold), and ``redistribute(mesh, [target])``.

While a default process group exists, shardwise treats meshes as meshes of
processes, so the suite enters this context only around DTensor calls
(:class:`LocalDTensor` creates and destroys the fake group each time).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["LocalDTensor", "unavailable"]


def unavailable() -> str | None:
    """None when DTensor's LocalTensorMode can run here, else why not."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return "torch.distributed is not available in this build"
        if dist.is_initialized():
            return "a process group is already initialized in this process"
        from torch.distributed._local_tensor import LocalTensor, LocalTensorMode  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except Exception as err:  # any import problem means: not provided by this torch
        return f"{type(err).__name__}: {err}"
    return None


def _locals(t: Any) -> list[torch.Tensor]:
    """Per-rank local tensors of a DTensor result."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    loc = t.to_local()
    if isinstance(loc, AsyncCollectiveTensor):
        loc = loc.wait()
    inner = loc._local_tensors
    return [inner[r] for r in sorted(inner)]


class LocalDTensor:
    """DTensor inputs on a simulated ``n``-rank mesh, valid inside ``with``.

    ``shards``: each rank's Shard(0) block; ``partials``: each rank's Partial(sum)
    term; ``full``: the Replicated value (one buffer for every rank).
    """

    def __init__(self, n: int, shards: Sequence[torch.Tensor], partials: Sequence[torch.Tensor],
                 full: torch.Tensor) -> None:
        self.n = n
        self._bufs = (list(shards), list(partials), full)
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> LocalDTensor:
        import torch.distributed as dist
        from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
        from torch.testing._internal.distributed.fake_pg import FakeStore

        logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.n)
        stack = contextlib.ExitStack()
        stack.callback(dist.destroy_process_group)
        try:
            stack.enter_context(LocalTensorMode(self.n))
            self.mesh = mesh = init_device_mesh("cpu", (self.n,))
            shards, partials, full = self._bufs
            n, rows = self.n, shards[0].shape[0]
            shape, stride = (rows * n, *shards[0].shape[1:]), full.stride()

            def make(bufs: Sequence[torch.Tensor], placement: Any) -> Any:
                local = LocalTensor({r: bufs[r] for r in range(n)})
                return DTensor.from_local(local, mesh, [placement], run_check=False,
                                          shape=torch.Size(shape), stride=stride)

            self.s0 = make(shards, Shard(0))
            self.part = make(partials, Partial())
            self.rep = make([full] * n, Replicate())
            self.placements = {"R": [Replicate()], "S0": [Shard(0)], "S1": [Shard(1)]}
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def cases(self) -> dict[str, Callable[[], list[torch.Tensor]]]:
        """Each transition: a call returning the per-rank local results."""
        m, p = self.mesh, self.placements
        return {
            "S(0)->R": lambda: _locals(self.s0.redistribute(m, p["R"])),
            "S(0)->S(1)": lambda: _locals(self.s0.redistribute(m, p["S1"])),
            "P->R": lambda: _locals(self.part.redistribute(m, p["R"])),
            "P->S(0)": lambda: _locals(self.part.redistribute(m, p["S0"])),
            "R->S(0)": lambda: _locals(self.rep.redistribute(m, p["S0"])),
        }
