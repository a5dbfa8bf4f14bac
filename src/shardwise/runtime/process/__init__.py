"""Backend 2, the process mesh: one process per device (torch.distributed, Gloo or NCCL).

Modules: ``backend`` (the planner's steps on this process's block), ``functions`` (the
one autograd family: a spec per collective with its transpose), ``collectives`` (each
collective's transport and agreement check, written once), ``agreement`` and
``diagnose`` (the control message before data; naming what failed), ``groups``
(process groups over mesh axes), ``spmd`` (shard_map: the lax collectives over
groups), ``world`` (the one :class:`World` object: settings and every per-world cache).

This package re-exports the backend (the functions :func:`shardwise.runtime.backend_for`
hands to the core).
"""

from shardwise.runtime.process.backend import *  # noqa: F403  (the backend, re-exported whole)
from shardwise.runtime.process.backend import __all__ as __all__
