"""Multi-process runtime control: one process per device through torch.distributed.

The public face of :mod:`shardwise.api.distributed`, where it is defined.
"""

from shardwise.api.distributed import (
    CollectiveError,
    barrier,
    initialize,
    is_initialized,
    maybe_initialize,
    process_count,
    process_index,
    shutdown,
)

__all__ = [
    "CollectiveError",
    "barrier",
    "initialize",
    "is_initialized",
    "maybe_initialize",
    "process_count",
    "process_index",
    "shutdown",
]
