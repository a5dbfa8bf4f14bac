"""Plan before you buy: predict a training step's memory, communication and time on a
mesh of any size (``estimate``), fit a machine's profile (``calibrate``), and choose
the parallelism (``auto_plan``).

Invariants:
- Re-exports only; each name lives in one module of this package.
"""

from __future__ import annotations

from shardwise.planning.calibration import calibrate
from shardwise.planning.estimator import CommRow, Estimate, Memory, estimate, fake_world
from shardwise.planning.plans import ParallelPlan, Recompute
from shardwise.planning.profiles import PRESETS, Link, Profile, get_profile
from shardwise.planning.search import Candidate, PlanChoice, auto_plan, estimate_plan
from shardwise.planning.timing import Timing
from shardwise.planning.transformer import ModelConfig, Transformer

__all__ = ["PRESETS", "Candidate", "CommRow", "Estimate", "Link", "Memory", "ModelConfig",
           "ParallelPlan", "PlanChoice", "Profile", "Recompute", "Timing", "Transformer",
           "auto_plan", "calibrate", "estimate", "estimate_plan", "fake_world",
           "get_profile"]
