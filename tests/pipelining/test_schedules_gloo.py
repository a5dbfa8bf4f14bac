"""Every schedule on 4 Gloo processes (pp=4, and pp=2 x tp=2 with tensor-parallel
stages): per-microbatch losses, the output and every gradient equal single-device
torch (1e-5 relative) for m in {1, p, 2p, 4p}; stages that pass tuples and dicts. One
launch runs every case."""

from __future__ import annotations

from tests.helpers import pipe_bodies
from tests.helpers.harness import check_body

BODIES = ["body_every_schedule_pp4", "body_every_schedule_pp2_tp2", "body_structured_values_pp4"]


def test_every_schedule_pp4_equals_torch() -> None:
    check_body(pipe_bodies.__name__, BODIES, 4, "body_every_schedule_pp4")


def test_every_schedule_pp2_x_tp2_equals_torch() -> None:
    check_body(pipe_bodies.__name__, BODIES, 4, "body_every_schedule_pp2_tp2")


def test_stage_values_other_than_one_tensor_cross_processes() -> None:
    check_body(pipe_bodies.__name__, BODIES, 4, "body_structured_values_pp4")
