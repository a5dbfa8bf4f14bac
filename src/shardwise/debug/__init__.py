"""Debug tools: layout visualisation, collective accounting, fallback counting, memory
tracking."""

from shardwise.debug.comm import CommCounter
from shardwise.debug.fallbacks import FallbackCounter
from shardwise.debug.memory import MemoryTracker
from shardwise.debug.visualize import visualize

__all__ = ["CommCounter", "FallbackCounter", "MemoryTracker", "visualize"]
