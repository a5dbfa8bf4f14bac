"""Debug tools: layout visualisation and collective accounting."""

from shardwise.debug.comm import CommCounter
from shardwise.debug.visualize import visualize

__all__ = ["CommCounter", "visualize"]
