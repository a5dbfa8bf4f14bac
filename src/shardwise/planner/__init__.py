"""The resharding planner: a pure function from (source, target) layouts to steps.

Pure Python (no torch): a plan is computed, cached and printable before
anything runs. Each step is one collective (or one local op) over a group of
mesh axes, of a closed set of kinds (:class:`StepKind`, which each runtime
dispatches through a handler table); its ``before``/``after`` layouts chain
from source to target.

Modules: :mod:`~shardwise.planner.steps` (``StepKind``, ``Step``, ``Plan``),
:mod:`~shardwise.planner.builder` (step accumulation, merging and bytes moved),
:mod:`~shardwise.planner.phases` (``Planner``: one method per phase below),
:mod:`~shardwise.planner.cache` (the cached ``make_plan``, ``permute_sources``),
:mod:`~shardwise.planner.transpose` (the collectives a plan's gradient runs).

Transition table (per mesh axis ``a``; ``S(d)`` = shards tensor dim ``d``):

    source        target        step
    R             S(d)          slice            local view, no communication
    S(d)          R             all_gather
    S(d)          S(e)          all_to_all       one collective, never gather+slice
    P(op)         R             all_reduce
    P(op)         S(d)          reduce_scatter
    P(op)         P(op2)        all_reduce, then make_partial
    R             P(op)         make_partial     local: identity element off the root
    S(d)          P(op)         all_gather, then make_partial
    S(a,b)        S(b,a)        permute          each device sends its block to one peer

The last row: a dim split over the same mesh axes in another order (evenly)
holds the same blocks on other devices, so one point-to-point permutation moves
them (a relabelling on the simulated mesh) instead of a gather and a slice.
Dims that trade axes (``[S(dp), S(tp)] -> [S(tp), S(dp)]``) go all_to_all,
permute, all_to_all: when no plain all_to_all applies, an axis moves into the
dim that wants it out of order, and a permute then puts that dim's target
prefix first and its leaving axes minor-most, where all_to_all can take them.

Order (the phases, ``Planner.PHASES``): all_to_all moves (with the permutes
they need) first, then slices (shrink the data), then partial resolution on the smallest data
(reduce_scatter where the target shards the axis, else all_reduce), then
all_gathers, the remaining slices, and make_partial (outer mesh axes first:
Partial axes reduce last axis first, so with mixed ops the outer identities
must be laid down before inner axes split them).
Steps over several axes of the same kind are merged into one collective over
the product group. When uneven pieces do not nest (e.g. 6 rows: 2-way
[3, 3] vs 4-way [2, 2, 1, 1]), a dim is gathered whole and re-sliced.
"""

from shardwise.planner.cache import make_plan, permute_sources
from shardwise.planner.steps import COLLECTIVES, Plan, Step, StepKind, check_handlers
from shardwise.planner.transpose import backward_steps, diverge_step

__all__ = ["COLLECTIVES", "Plan", "Step", "StepKind", "backward_steps", "check_handlers",
           "diverge_step", "make_plan", "permute_sources"]
