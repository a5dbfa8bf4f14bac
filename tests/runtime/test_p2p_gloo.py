"""Point-to-point transfers of pytrees on Gloo ranks, and stage submeshes used alone."""

from __future__ import annotations

from tests.helpers import pipe_bodies
from tests.helpers.harness import check_body

BODIES = ["body_p2p_round_trip", "body_stage_groups_and_transport", "body_shape_disagrees"]


def test_p2p_round_trip_keeps_values_dtypes_and_changing_shapes() -> None:
    check_body(pipe_bodies.__name__, BODIES, 4, "body_p2p_round_trip")


def test_stage_submeshes_run_alone_and_tensors_cross_with_their_layout() -> None:
    check_body(pipe_bodies.__name__, BODIES, 4, "body_stage_groups_and_transport")


def test_a_block_of_the_wrong_shape_is_refused() -> None:
    check_body(pipe_bodies.__name__, BODIES, 4, "body_shape_disagrees")
