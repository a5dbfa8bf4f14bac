"""Expert parallelism on 4 Gloo processes: one launch runs every body of
``expert_bodies`` (ragged all_to_all, dropless and capacity dispatch beside the
per-expert loop, the MoE GPT on dp2ep x tp)."""

from __future__ import annotations

import pytest

from tests.helpers import expert_bodies
from tests.helpers.harness import check_body


@pytest.mark.parametrize("name", expert_bodies.BODIES)
def test_expert_body_on_gloo(name: str) -> None:
    check_body(expert_bodies.__name__, expert_bodies.BODIES, 4, name)
