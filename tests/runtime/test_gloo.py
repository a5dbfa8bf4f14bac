"""The shared test bodies on real Gloo process groups (2 and 4 ranks on 127.0.0.1)."""

from __future__ import annotations

import pytest

from tests.helpers import bodies
from tests.helpers.harness import check_body


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", bodies.BODIES)
def test_body_on_gloo(world: int, name: str) -> None:
    check_body(bodies.__name__, bodies.BODIES, world, name)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", bodies.BODIES)
def test_body_simulated(world: int, name: str) -> None:
    getattr(bodies, name)(world)
