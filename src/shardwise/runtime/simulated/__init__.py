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

from shardwise.runtime.simulated.backend import (
    assemble,
    buffer_reuse,
    device_of,
    diverge,
    execute_plan,
    global_value,
    make_partial,
    owned,
    permute,
    reduce,
    reduce_scatter,
    relabel,
    rep_indices,
    run_spmd,
    run_step,
    set_buffer_reuse,
    spmd_outputs,
)

__all__ = [
    "assemble",
    "buffer_reuse",
    "device_of",
    "diverge",
    "execute_plan",
    "global_value",
    "make_partial",
    "owned",
    "permute",
    "reduce",
    "reduce_scatter",
    "relabel",
    "rep_indices",
    "run_spmd",
    "run_step",
    "spmd_outputs",
    "set_buffer_reuse",
]
