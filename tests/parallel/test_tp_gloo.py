"""shardwise.parallel (tensor and sequence parallel GPT, loss parallel) on 4 Gloo
processes: one launch runs every body (tp_bodies.py)."""

from __future__ import annotations

import pytest
import tp_bodies
from harness import check_body


@pytest.mark.parametrize("name", tp_bodies.BODIES)
def test_tp_body_on_gloo(name: str) -> None:
    check_body("tp_bodies", tp_bodies.BODIES, 4, name)
