"""Pipeline parallelism: stages on a mesh axis, torch's schedules, a simulator.

``pipeline(model, mesh, split_points=[...])`` cuts a model into stages on the mesh's
``pp`` axis (:mod:`~shardwise.pipelining.stage`); a schedule class
(:mod:`~shardwise.pipelining.executor`) runs one training step over them, moving
activations through a transport (:mod:`~shardwise.pipelining.transport`); every
schedule is an action table (:mod:`~shardwise.pipelining.actions`).
"""

from shardwise.pipelining.actions import Action, Kind, parse_table, read_csv, write_csv
from shardwise.pipelining.executor import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleFromTable,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from shardwise.pipelining.grads import clip_grad_norm_
from shardwise.pipelining.simulate import Simulation, Span, simulate
from shardwise.pipelining.stage import Pipe, Stage, pipeline
from shardwise.pipelining.tables import SCHEDULES, compute_table, lower, stage_ranks, validate
from shardwise.pipelining.transport import SimTransport, Transport

__all__ = [
    "Action",
    "Kind",
    "SCHEDULES",
    "Pipe",
    "PipelineSchedule",
    "Schedule1F1B",
    "ScheduleFromTable",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "SimTransport",
    "Simulation",
    "Span",
    "Stage",
    "Transport",
    "clip_grad_norm_",
    "compute_table",
    "lower",
    "parse_table",
    "pipeline",
    "read_csv",
    "simulate",
    "stage_ranks",
    "validate",
    "write_csv",
]
