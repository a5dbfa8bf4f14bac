"""Debug tools: layout visualisation, collective accounting, fallback and graph-break
counting, memory tracking."""

from shardwise.debug.comm import CommCounter
from shardwise.debug.fallbacks import FallbackCounter
from shardwise.debug.graph_breaks import GraphBreakCounter
from shardwise.debug.memory import MemoryTracker
from shardwise.debug.visualize import visualize

__all__ = ["CommCounter", "FallbackCounter", "GraphBreakCounter", "MemoryTracker", "visualize"]
