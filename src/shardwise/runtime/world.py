"""Moved to :mod:`shardwise.runtime.process.world` (the process world); this path stays
importable for programs and tools that used it."""

from shardwise.runtime.process.world import WORLD, World

__all__ = ["WORLD", "World"]
