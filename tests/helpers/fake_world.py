"""A clean process-runtime state for tests that fake torch.distributed's calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from shardwise.runtime.process.world import WORLD


@contextlib.contextmanager
def clean_world() -> Iterator[None]:
    """``WORLD`` reset, with the stream-group test hook off (whatever the environment
    asked for), and reset again afterwards with the hook as it was."""
    force = WORLD.force_stream_groups
    WORLD.reset()
    WORLD.force_stream_groups = False
    try:
        yield
    finally:
        WORLD.reset()
        WORLD.force_stream_groups = force
