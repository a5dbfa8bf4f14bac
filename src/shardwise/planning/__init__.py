"""Plan before you buy: predict a training step's memory, communication and time on a
mesh of any size (``estimate``), fit a machine's profile (``calibrate``), and choose
the parallelism (``auto_plan``).

Invariants:
- Re-exports only; each name lives in one module of this package.
"""

from __future__ import annotations

from shardwise.planning.estimator import CommRow, Estimate, Memory, estimate
from shardwise.planning.profiles import PRESETS, Link, Profile, get_profile
from shardwise.planning.timing import Timing

__all__ = ["PRESETS", "CommRow", "Estimate", "Link", "Memory", "Profile", "Timing",
           "estimate", "get_profile"]
