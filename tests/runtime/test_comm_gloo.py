"""The hand-sharded Megatron GPT's communication on 4 Gloo processes (one launch for
every body) and on the simulated mesh: the same counts and bytes, forward and backward."""

from __future__ import annotations

import pytest

from tests.helpers import comm_bodies
from tests.helpers.harness import check_body


@pytest.mark.parametrize("name", comm_bodies.BODIES)
def test_comm_body_on_gloo(name: str) -> None:
    check_body(comm_bodies.__name__, comm_bodies.BODIES, 4, name)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("name", comm_bodies.BODIES)
def test_comm_body_simulated(n: int, name: str) -> None:
    getattr(comm_bodies, name)(n)
