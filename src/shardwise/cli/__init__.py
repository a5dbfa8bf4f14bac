"""Floor 4: the ``shardwise`` command (``main``: demo, bench, info) and its demo."""

from shardwise.cli.command import main

__all__ = ["main"]
