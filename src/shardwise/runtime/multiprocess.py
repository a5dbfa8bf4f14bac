"""Moved to :mod:`shardwise.runtime.process` (the torch.distributed backend); this path
stays importable."""

from shardwise.runtime.process.backend import (
    assemble,
    device_of,
    diverge,
    execute_plan,
    global_value,
    make_partial,
    owned,
    permute,
    relabel,
    run_spmd,
    run_step,
    spmd_outputs,
)

__all__ = ["assemble", "device_of", "diverge", "execute_plan", "global_value", "make_partial",
           "owned", "permute", "relabel", "run_spmd", "run_step", "spmd_outputs"]
