"""Debug tools: layout visualisation, collective accounting, fallback counting."""

from shardwise.debug.comm import CommCounter
from shardwise.debug.fallbacks import FallbackCounter
from shardwise.debug.visualize import visualize

__all__ = ["CommCounter", "FallbackCounter", "visualize"]
