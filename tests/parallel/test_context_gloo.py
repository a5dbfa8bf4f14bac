"""Context parallel on 4 Gloo processes: one launch runs every body of cp_bodies.py
(attention against torch at cp = 4 and cp = 2 beside dp = 2, the collectives beside
their closed forms, the region's order, the GPT on cp x tp = 2x2)."""

from __future__ import annotations

import pytest

from tests.helpers import cp_bodies
from tests.helpers.harness import check_body


@pytest.mark.parametrize("name", cp_bodies.BODIES)
def test_cp_body_on_gloo(name: str) -> None:
    check_body(cp_bodies.__name__, cp_bodies.BODIES, 4, name)
