"""Pipeline parallelism: stages on a mesh axis, torch's schedules, a simulator.

Work in progress (issue 23); the modules below fill in as they land.
"""

from shardwise.pipelining.actions import Action, Kind, parse_table, read_csv, write_csv
from shardwise.pipelining.schedules import SCHEDULES, compute_table, lower, stage_ranks, validate
from shardwise.pipelining.simulate import Simulation, Span, simulate

__all__ = ["Action", "Kind", "parse_table", "read_csv", "write_csv"]
__all__ += ["SCHEDULES", "compute_table", "lower", "stage_ranks", "validate"]
__all__ += ["Simulation", "Span", "simulate"]
