"""Independent oracle for the value tests (tests/api, and the compute ops through computecheck).

``global_of(t)`` rebuilds a Tensor's global value from its raw shards with its own
copy of the split rule (DESIGN.md §2), checking on the way that every shard has the
right shape and that replicas hold equal values. Partial axes are reduced last mesh
axis first (the order the planner documents for mixed reduce ops).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

import shardwise as sw
from shardwise.sharding import DeviceMesh, Layout, ReduceOp

REDUCE = {
    ReduceOp.SUM: lambda t, d: t.sum(d),
    ReduceOp.AVG: lambda t, d: t.mean(d),
    ReduceOp.MIN: lambda t, d: t.amin(d),
    ReduceOp.MAX: lambda t, d: t.amax(d),
    ReduceOp.PROD: lambda t, d: t.prod(d),
}


def split(size: int, n: int, k: int) -> tuple[int, int]:
    """Piece ``k`` of ``size`` split into ``n``: earlier pieces get the remainder."""
    base, rem = divmod(size, n)
    start = k * base + min(k, rem)
    return start, start + base + (1 if k < rem else 0)


def coord(mesh: DeviceMesh, k: int) -> tuple[int, ...]:
    out = []
    for size in reversed(mesh.mesh_shape):
        k, r = divmod(k, size)
        out.append(r)
    return tuple(reversed(out))


def block(mesh: DeviceMesh, layout: Layout, shape: Sequence[int], k: int) -> tuple[slice, ...]:
    """The slice of the global value device ``k`` holds."""
    c = coord(mesh, k)
    out = []
    for size, axes in zip(shape, layout.dims, strict=True):
        piece, pieces = 0, 1
        for a in axes:
            piece = piece * mesh.mesh_shape[a] + c[a]
            pieces *= mesh.mesh_shape[a]
        out.append(slice(*split(size, pieces, piece)))
    return tuple(out)


def global_of(t: sw.Tensor) -> torch.Tensor:
    """The global value of ``t`` computed from its shards alone."""
    mesh, layout, shape = t.mesh, t.dist_layout, t.shape
    assert len(t.shards) == mesh.num_devices
    paxes = [a for a, op in enumerate(layout.partial) if op is not None]
    stacked = torch.zeros((*(mesh.mesh_shape[a] for a in paxes), *shape), dtype=t.dtype)
    seen: dict[tuple, torch.Tensor] = {}
    for k, shard in enumerate(t.shards):
        c = coord(mesh, k)
        sl = block(mesh, layout, shape, k)
        pc = tuple(c[a] for a in paxes)
        want = tuple(s.stop - s.start for s in sl)
        assert tuple(shard.shape) == want, (k, tuple(shard.shape), want, layout)
        assert shard.dtype == t.dtype
        local = shard.detach().cpu()
        key = (pc, tuple((s.start, s.stop) for s in sl))
        if key in seen:
            assert torch.equal(seen[key], local), f"replicas of device {k} differ"
            continue
        seen[key] = local
        stacked[pc + sl] = local
    for i in reversed(range(len(paxes))):
        stacked = REDUCE[layout.partial[paxes[i]]](stacked, i)
    return stacked


def assert_shares_replicas(t: sw.Tensor) -> None:
    """Devices differing only on replicated mesh axes hold one tensor object."""
    mesh, layout = t.mesh, t.dist_layout
    used = set(layout.sharded_axes) | set(layout.partial_axes)
    for k in range(mesh.num_devices):
        c = coord(mesh, k)
        root = [x if a in used else 0 for a, x in enumerate(c)]
        j = mesh.index_of(root)
        assert t.shards[k] is t.shards[j], f"device {k} does not share device {j}'s buffer"


class Snapshot:
    """Identity and values of a Tensor's shards, to check an op did not mutate it."""

    def __init__(self, t: sw.Tensor) -> None:
        self.t = t
        self.ids = [id(s) for s in t.shards]
        self.values = [s.detach().clone() for s in t.shards]
        self.layout, self.shape = t.dist_layout, t.shape

    def check(self) -> None:
        t = self.t
        assert [id(s) for s in t.shards] == self.ids
        assert t.dist_layout == self.layout and t.shape == self.shape
        for s, v in zip(t.shards, self.values, strict=True):
            assert torch.equal(s.detach(), v)


def ints(shape: Sequence[int], seed: int = 0, low: int = -3, high: int = 4) -> torch.Tensor:
    """Integer-valued float data (reductions of it are exact)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, tuple(shape), generator=gen).float()


def from_blocks(layout: Layout, shape: Sequence[int], seed: int = 0) -> sw.Tensor:
    """A Tensor in ``layout`` whose Partial devices hold independent random blocks."""
    mesh = layout.mesh
    gen = torch.Generator().manual_seed(seed)
    locals_ = []
    for k in range(mesh.num_devices):
        sl = block(mesh, layout, shape, k)
        locals_.append(torch.randint(-3, 4, tuple(s.stop - s.start for s in sl),
                                     generator=gen).float())
    return sw.from_local(locals_, layout, shape)


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def whole_value(t: sw.Tensor) -> torch.Tensor | None:
    """The global value ``t`` is held in when the runtime holds it whole (a mesh this
    process holds wholly: ops run once on it), else None (held as blocks)."""
    from shardwise.runtime.local import Whole

    local = t._local
    return local.value if isinstance(local, Whole) else None
