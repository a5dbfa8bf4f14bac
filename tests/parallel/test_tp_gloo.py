"""shardwise.parallel (tensor and sequence parallel GPT, loss parallel) on 4 Gloo
processes: one launch runs every body (tp_bodies.py)."""

from __future__ import annotations

import pytest

from tests.helpers import tp_bodies
from tests.helpers.harness import check_body


@pytest.mark.parametrize("name", tp_bodies.BODIES)
def test_tp_body_on_gloo(name: str) -> None:
    check_body(tp_bodies.__name__, tp_bodies.BODIES, 4, name)
