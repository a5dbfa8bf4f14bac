"""fully_shard (alone, and over hand TP) on 4 real Gloo processes: one launch runs
every body of ``fsdp_bodies`` (see ``harness.py``: bounded, tracebacks per rank)."""

from __future__ import annotations

import pytest

from tests.helpers import fsdp_bodies
from tests.helpers.harness import check_body


@pytest.mark.parametrize("name", fsdp_bodies.BODIES)
def test_fsdp_body_on_gloo(name: str) -> None:
    check_body(fsdp_bodies.__name__, fsdp_bodies.BODIES, 4, name)
