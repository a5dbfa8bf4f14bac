"""clip_grad_norm_ over pipeline stages on 4 real Gloo processes (one launch runs every
body of ``pp_clip_bodies``)."""

from __future__ import annotations

import pytest

from tests.helpers import pp_clip_bodies
from tests.helpers.harness import check_body


@pytest.mark.parametrize("name", pp_clip_bodies.BODIES)
def test_clip_body_on_gloo(name: str) -> None:
    check_body(pp_clip_bodies.__name__, pp_clip_bodies.BODIES, 4, name)
