"""Bodies for the Backend protocol's point-to-point links, pipeline stages and world
services, the same on ``n`` Gloo processes and on the simulated backend (one process
holding every stage: its links are loopbacks, its world one process).

Every body reaches the runtime only through ``shardwise.runtime`` (``backend_for``,
``world_backend``), as floor 4 does.
"""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated
from shardwise.pipelining.transport_process import ProcessTransport
from shardwise.runtime import backend_for, world_backend

BODIES = ["body_links_in_both_directions", "body_transport_through_links",
          "body_world_services"]


def _stages(n: int) -> tuple[list[DeviceMesh], list[bool]]:
    """``n`` pipeline stages of one device each, made ready, and which ones are here."""
    mesh = DeviceMesh.cpu((n, 1), ("pp", "x"))
    backend = backend_for(mesh)
    stages = backend.prepare_stages(mesh, "pp", [mesh.submesh(pp=i) for i in range(n)])
    assert stages == [mesh.submesh(pp=i) for i in range(n)]
    return stages, [bool(backend_for(s).owned(s)) for s in stages]


def _tensors(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(2 + step, 3, generator=g), torch.arange(step + 1),
            torch.tensor([True, False]), torch.empty(0, 4, dtype=torch.float64)]


def body_links_in_both_directions(n: int) -> None:
    """Stage 2i sends to 2i+1 and gets back twice the values, over the links of both
    directions; shapes change from step to step; the received tensors are equal, new
    leaves that never require grad."""
    stages, here = _stages(n)
    backend = backend_for(stages[0])
    for step in range(3):
        for a in range(0, n - 1, 2):
            if not (here[a] or here[a + 1]):
                continue   # (a link has no end here: the process backend refuses it)
            fwd = backend.link(stages[a], stages[a + 1], 0, (a, a + 1))
            back = backend.link(stages[a + 1], stages[a], 0, (a + 1, a))
            sent = _tensors(step)
            if here[a]:
                fwd.send({"step": step, "from": a},
                         [t.requires_grad_(t.is_floating_point()) for t in sent], f"F{step}")
            if here[a + 1]:
                info, got = fwd.recv(f"F{step}")
                assert info == {"step": step, "from": a}, info
                assert len(got) == len(sent)
                for x, y in zip(sent, got, strict=True):
                    assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                    assert not y.requires_grad
                back.send(None, [2 * y for y in got[:2]], f"B{step}")
            if here[a]:
                info, got = back.recv(f"B{step}")
                assert info is None
                assert all(torch.equal(y, 2 * x.detach()) for x, y in zip(sent[:2], got))
            if here[a] != here[a + 1]:  # a process link: its peer is the other stage's
                peer = stages[a + 1 if here[a] else a].devices[0].id
                assert fwd.peer == back.peer == peer, (fwd.peer, peer)
            else:
                assert fwd.peer is None and back.peer is None
    backend.flush_links()


def body_transport_through_links(n: int) -> None:
    """The pipeline transport on stages of one device: a shardwise Tensor crosses with
    its layout and grad flag, with plain tensors and scalars beside it, and its
    gradient comes back."""
    stages, here = _stages(n)
    t = ProcessTransport(stages)
    for mb in range(2):
        for a in range(0, n - 1, 2):
            sub, nxt = stages[a], stages[a + 1]
            full = torch.arange(12.0).reshape(3, 4) + mb
            if here[a]:
                act = sw.tensor(full, sharding=PlacementMapping(sub, [Replicated()]),
                                requires_grad=True) * 2
                t.send((act, None, {"mb": mb, "plain": torch.ones(mb + 1)}), a, a + 1,
                       f"F{mb}")
            if here[a + 1]:
                act, none, extra = t.recv(a, a + 1, f"F{mb}")
                assert none is None and extra["mb"] == mb
                assert torch.equal(extra["plain"], torch.ones(mb + 1))
                assert isinstance(act, sw.Tensor) and act.mesh == nxt, act
                assert act.requires_grad and act.is_leaf
                assert torch.equal(act.to_torch(), 2 * full)
                (act * 3).sum().backward()
                t.send(act.grad, a + 1, a, f"B{mb}")
            if here[a]:
                grad = t.recv(a + 1, a, f"B{mb}")
                assert isinstance(grad, sw.Tensor) and grad.mesh == sub
                assert torch.equal(grad.to_torch(), torch.full((3, 4), 3.0))
    t.flush()


def body_world_services(n: int) -> None:
    """Index and count, a barrier, a gather over the world in rank order, and the run's
    first failure, the same on every process."""
    world = world_backend()
    me, count = world.process_index(), world.process_count()
    assert 0 <= me < count and count in (1, n), (me, count)
    world.barrier("link bodies: world services")
    got = world.gather_world(torch.tensor([me, 10 * me]), "link bodies: a gather")
    assert got.tolist() == [[r, 10 * r] for r in range(count)], got
    first = world.record_failure(f"rank {me} failed (a test)")
    assert "failed (a test)" in first, first
    world.barrier("link bodies: recorded")
    assert world.first_failure() == first, (world.first_failure(), first)
