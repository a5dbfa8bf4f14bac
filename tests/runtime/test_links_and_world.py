"""The Backend protocol's point-to-point links, pipeline stages and world services: one
set of bodies (tests/helpers/link_bodies.py) on 4 Gloo processes (one launch) and on
the simulated backend, where every link is a loopback and the world one process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from shardwise import DeviceMesh
from shardwise.runtime import backend_for, world_backend
from shardwise.runtime.loopback import Loopback
from shardwise.sharding.errors import CollectiveError
from tests.helpers import link_bodies
from tests.helpers.harness import check_body


@pytest.mark.parametrize("name", link_bodies.BODIES)
def test_body_on_gloo(name: str) -> None:
    check_body(link_bodies.__name__, link_bodies.BODIES, 4, name)


@pytest.fixture
def fresh_world() -> Iterator[None]:
    """The simulated world started afresh (no links, no failure), and ended after."""
    world = world_backend()
    world.begin_world(timeout_s=60.0)
    yield
    world.end_world()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", link_bodies.BODIES)
def test_body_simulated(fresh_world: None, name: str, n: int) -> None:
    getattr(link_bodies, name)(n)


def test_a_simulated_link_is_one_loopback_for_both_ends(fresh_world: None) -> None:
    mesh = DeviceMesh.cpu((2, 1), ("pp", "x"))
    a, b = mesh.submesh(pp=0), mesh.submesh(pp=1)
    backend = backend_for(mesh)
    link = backend.link(a, b, 0, (0, 1))
    assert isinstance(link, Loopback)
    assert backend.link(a, b, 0, (0, 1)) is link
    assert backend.link(b, a, 0, (1, 0)) is not link   # the other direction
    world_backend().end_world()
    assert backend.link(a, b, 0, (0, 1)) is not link   # a new world, new links


def test_a_loopback_refuses_a_receive_never_sent_and_a_key_sent_twice() -> None:
    link = Loopback("device 0 of stage 0 -> stage 1")
    with pytest.raises(CollectiveError, match=r"receive of F0 \(device 0 of stage 0 -> "
                                              r"stage 1\): nothing was sent under this key"):
        link.recv("F0")
    link.send(None, [torch.ones(1)], "F0")
    with pytest.raises(CollectiveError, match=r"send of F0 .*sent before and not received"):
        link.send(None, [torch.ones(1)], "F0")
    assert link.recv("F0")[0] is None
