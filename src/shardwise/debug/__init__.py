"""Debug tools: layout visualisation (and, later, collective accounting)."""

from shardwise.debug.visualize import visualize

__all__ = ["visualize"]
