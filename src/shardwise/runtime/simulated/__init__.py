"""Backend 1, the simulated mesh: every device of the mesh in this process.

Modules: ``backend`` (the planner's steps on lists of per-device blocks), ``collectives``
(what a group of devices computes from its members' values: written once, used by the
backend, shard_map's device threads and the per-device graph ops), ``host_paths`` (the
compiled fast path of host meshes), ``spmd`` (shard_map: one thread per device, lax
collectives by rendezvous). Shared with the process backend, one floor up in
``runtime/``: ``blocks`` (block recipes) and ``buffers`` (large result buffers).

This package re-exports the backend, so ``shardwise.runtime.simulated.set_buffer_reuse``
(and the rest) stay where users found them.
"""

from shardwise.runtime.simulated.backend import *  # noqa: F403  (the backend, re-exported whole)
from shardwise.runtime.simulated.backend import __all__ as __all__
