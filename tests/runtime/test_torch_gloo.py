"""torch-native bodies on real Gloo process groups (2 and 4 ranks) and simulated."""

from __future__ import annotations

import pytest

from tests.helpers import torch_bodies
from tests.helpers.harness import check_body


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", torch_bodies.BODIES)
def test_torch_body_on_gloo(world: int, name: str) -> None:
    check_body(torch_bodies.__name__, torch_bodies.BODIES, world, name)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", torch_bodies.BODIES)
def test_torch_body_simulated(world: int, name: str) -> None:
    getattr(torch_bodies, name)(world)
