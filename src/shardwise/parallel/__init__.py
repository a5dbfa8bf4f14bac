"""Module-level parallelism on ordinary ``nn.Module`` code (DTensor's names).

``parallelize_module(model, mesh, plan)`` lays submodules out over one mesh axis with
parallel styles (tensor and sequence parallelism); ``loss_parallel()`` keeps the
class-sharded logits of a column-parallel head sharded through ``F.cross_entropy``;
``fully_shard(module, mesh)`` adds fully sharded data parallelism (FSDP2's semantics);
``hf_plan(model)`` reads a transformers model's own tensor-parallel plan;
``check_replicas(model)`` checks that every replica of its replicated values is equal;
``context_parallel(mesh)`` runs attention over a sequence sharded on a ``cp`` axis.
``ExpertParallel()`` lays an experts module's experts over an ``ep`` axis and
dispatches its tokens to them by all_to_all.
Values stay global: the model's code needs no change.

Invariants:
- Re-exports only; each name lives in one module of this package.
"""

from __future__ import annotations

from shardwise.parallel.api import parallelize_module
from shardwise.parallel.context import ContextParallel, context_parallel
from shardwise.parallel.experts import ExpertParallel
from shardwise.parallel.fsdp import MixedPrecisionPolicy, fully_shard, memory_per_device
from shardwise.parallel.hf import hf_plan
from shardwise.parallel.loss import loss_parallel
from shardwise.parallel.replicas import check_replicas
from shardwise.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "ContextParallel",
    "ExpertParallel",
    "MixedPrecisionPolicy",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "check_replicas",
    "context_parallel",
    "fully_shard",
    "hf_plan",
    "loss_parallel",
    "memory_per_device",
    "parallelize_module",
]
