"""``hf_plan``: a Hugging Face ``transformers`` model's own tensor-parallel plan as
shardwise styles, for ``parallelize_module(model, mesh, hf_plan(model), axis="tp")``.

transformers models ship their plan as strings: ``config.base_model_tp_plan`` (names
inside the base model, e.g. ``"layers.*.self_attn.q_proj": "colwise"``) and the
model's ``_tp_plan`` (the head's, ``"lm_head": "colwise_gather_output"``; an instance's
``_tp_plan`` already holds both, prefixed). Values in shardwise are global, so a style
string only says where parameters and activations are laid out; transformers' styles
that exist to compute on local shards (``moe_tp_experts``, ``local_params``,
``replicated_with_grad_allreduce``, ...) need nothing here, and the model's code runs
unchanged whatever the plan (a plan changes the communication, never the values).

Invariants:
- transformers is never imported: the model is read by duck typing (``_tp_plan``,
  ``config.base_model_tp_plan``, ``base_model_prefix``, its module and parameter names).
- Every entry's wildcards are expanded to the model's own names (``*`` stands for one
  dotted component, as in transformers); an entry that names nothing in this model (a
  layer kind this config does not build) is dropped, as transformers drops it.
- An entry naming a parameter (the stacked weights of MoE experts) becomes a
  :class:`ShardParameters` style on the module that owns it.
- An unknown style string raises a ShardingError naming it and the known ones.
- A model that ``parallelize_module``/``fully_shard`` lay out and that has a
  ``save_pretrained`` taking ``state_dict`` saves global values
  (:func:`gather_on_save`): safetensors reads raw bytes through ``data_ptr()``, which a
  shardwise Tensor (a wrapper with no storage, as DTensor) does not have, and
  transformers gathers only DTensors, and only under its own ``distributed_config``.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase
from typing import Any

import torch.nn as nn

from shardwise.parallel.placing import shard_parameter
from shardwise.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Placement, Replicated, Sharded

__all__ = ["ShardParameters", "gather_on_save", "hf_plan", "name_matches"]


class ShardParameters(ParallelStyle):
    """Lay out some of a module's own parameters (``{name: placement}``) on the plan's
    mesh axis; no hooks: the module's code runs on them unchanged.

    >>> from shardwise.parallel import parallelize_module
    >>> mesh = DeviceMesh.cpu(2, "tp")
    >>> m = parallelize_module(torch.nn.Linear(4, 6), mesh,
    ...                        ShardParameters({"weight": Sharded(1)}))
    >>> m.weight.placements, type(m.bias).__name__
    ((Sharded(axis=1),), 'Parameter')
    """

    def __init__(self, placements: Mapping[str, Placement]) -> None:
        if not isinstance(placements, Mapping):
            raise ShardingTypeError(f"ShardParameters takes a dict of parameter name -> "
                                    f"placement. Got {placements!r}.")
        self.placements = dict(placements)

    def apply(self, module: nn.Module, mesh: DeviceMesh, axis: int, name: str) -> None:
        for pname, placement in self.placements.items():
            if pname not in module._parameters:
                raise ShardingError(
                    f"ShardParameters: {name or 'the module'!r} ({type(module).__name__}) "
                    f"has no parameter {pname!r}; its own parameters are "
                    f"{sorted(module._parameters)}.")
            shard_parameter(module, pname, mesh, axis, placement)


# transformers' style strings (transformers.distributed.tensor_parallel, 4.50 to 5.x):
# a module's style, or (for an entry naming a parameter) the parameter's placement from
# its rank. None: nothing to do on global values.
_R, _S0 = Replicated(), Sharded(0)


def _out_dim(ndim: int) -> Placement:
    return Sharded(max(ndim - 2, 0))  # Linear [out, in], MoE experts [E, out, in]


def _in_dim(ndim: int) -> Placement:
    return Sharded(ndim - 1) if ndim >= 2 else _R  # a rowwise bias is added once, whole


_COLWISE = (ColwiseParallel, _out_dim)
_ROWWISE = (RowwiseParallel, _in_dim)
_NOTHING: tuple[None, None] = (None, None)
StyleFactory = Callable[[], ParallelStyle]
_STYLES: dict[str, tuple[StyleFactory | None, Callable[[int], Placement] | None]] = {
    "colwise": _COLWISE,
    "local_colwise": _COLWISE,
    "packed_colwise": _COLWISE,  # gate|up packed: contiguous blocks; chunk() reshards
    "colwise_rep": (lambda: ColwiseParallel(output_layouts=_R), _out_dim),
    "colwise_gather_output": (lambda: ColwiseParallel(output_layouts=_R), _out_dim),
    "rowwise": _ROWWISE,
    "local_rowwise": _ROWWISE,
    "packed_rowwise": _ROWWISE,
    "local_packed_rowwise": _ROWWISE,
    "rowwise_rep": (lambda: RowwiseParallel(input_layouts=_R), _in_dim),
    "rowwise_split_input": (lambda: RowwiseParallel(input_layouts=_R), _in_dim),
    "embedding_rowwise": (RowwiseParallel, lambda n: _S0),  # the vocabulary
    "embedding_colwise": (lambda: ColwiseParallel(output_layouts=_R), lambda n: Sharded(1)),
    "sequence_parallel": (SequenceParallel, None),
    # local-compute styles: all-reduces of partial shard results, gradient all-reduces,
    # replicated parameters. Global values get these from sharding propagation.
    "replicate": _NOTHING,
    "replicated_with_grad_allreduce": _NOTHING,
    "local": _NOTHING,
    "local_params": _NOTHING,
    "gather": _NOTHING,
    "all_reduce": _NOTHING,
    "moe_tp_experts": _NOTHING,
    "moe_identity_expert": _NOTHING,  # divides by the tp size to undo a local sum
    "mla_kv_a_proj": _NOTHING,
}


def name_matches(pattern: str, name: str) -> bool:
    """Whether module or parameter ``name`` matches plan key ``pattern``, one dotted
    component at a time with ``fnmatch`` (``*`` stands for one component, as in
    transformers' plans and ``parallelize_module``'s).

    >>> name_matches("layers.*.wq", "layers.3.wq"), name_matches("layers.*", "layers.3.wq")
    (True, False)
    """
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for p, n in zip(parts, names))


def _model_plan(model: nn.Module) -> dict[str, str]:
    """transformers' plan of ``model``: the base model's config plan under its prefix,
    then the model's own ``_tp_plan`` (an instance's already holds both)."""
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "") or ""
    if base:
        inner = getattr(model, prefix, None) if prefix else None
        at = f"{prefix}." if isinstance(inner, nn.Module) and inner is not model else ""
        plan.update({at + k: v for k, v in base.items()})
    plan.update(dict(getattr(model, "_tp_plan", None) or {}))
    return plan


def hf_plan(model: nn.Module, plan: Mapping[str, str] | None = None
            ) -> dict[str, ParallelStyle]:
    """``model``'s own tensor-parallel plan (transformers' strings) as shardwise styles,
    keyed by module name, for ``parallelize_module(model, mesh, hf_plan(model), axis="tp")``.

    Args:
        model: a transformers ``PreTrainedModel`` (read by duck typing), or any module
            when ``plan`` is given.
        plan: entries that add to or replace the model's own (transformers' names and
            strings, e.g. ``{"transformer.h.*.attn.c_attn": "colwise"}`` for GPT-2,
            which ships no plan).

    Returns:
        A dict of module names (wildcards expanded) to styles.

    transformers' strings and what they become (values stay global)::

        colwise, local_colwise, packed_colwise   ColwiseParallel(); a parameter: Sharded(ndim-2)
        colwise_rep, colwise_gather_output       ColwiseParallel(output_layouts=Replicated())
        rowwise, local_rowwise, packed_rowwise   RowwiseParallel(); a parameter: Sharded(-1)
        rowwise_rep, rowwise_split_input         RowwiseParallel(input_layouts=Replicated())
        embedding_rowwise / embedding_colwise    the table's vocabulary / embedding dim
        sequence_parallel                        SequenceParallel()
        replicate, gather, all_reduce, local*,   nothing: sharding propagation places
        moe_tp_experts, replicated_with_...      and reduces global values

    >>> class Block(torch.nn.Module):
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
    >>> class Tiny(torch.nn.Module):
    ...     _tp_plan = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.layers = torch.nn.ModuleList([Block(), Block()])
    >>> sorted(hf_plan(Tiny()).items())  # doctest: +NORMALIZE_WHITESPACE
    [('layers.0.down', RowwiseParallel()), ('layers.0.up', ColwiseParallel()),
     ('layers.1.down', RowwiseParallel()), ('layers.1.up', ColwiseParallel())]
    """
    if not isinstance(model, nn.Module):
        raise ShardingTypeError(f"hf_plan takes a transformers model (an nn.Module). Got "
                                f"{type(model).__name__}.")
    entries = _model_plan(model)
    entries.update(dict(plan or {}))
    if not entries:
        raise ShardingError(
            f"{type(model).__name__} ships no tensor-parallel plan (its config's "
            "base_model_tp_plan and its _tp_plan are empty). Pass one in transformers' "
            "strings, e.g. hf_plan(model, {'transformer.h.*.attn.c_attn': 'colwise', "
            "'transformer.h.*.attn.c_proj': 'rowwise'}), or write a shardwise plan.")
    modules = {n: m for n, m in model.named_modules() if n}
    params = dict(model.named_parameters(remove_duplicate=False))
    styles: dict[str, ParallelStyle] = {}
    shards: dict[str, dict[str, Placement]] = {}
    for pattern, kind in entries.items():
        if kind not in _STYLES:
            raise ShardingError(
                f"hf_plan: {type(model).__name__}'s plan maps {pattern!r} to the style "
                f"{kind!r}, which shardwise does not know. Known styles: "
                f"{', '.join(sorted(_STYLES))}. Pass plan={{{pattern!r}: <one of those>}} "
                "to replace it, or write that module's shardwise style by hand.")
        module_style, param_placement = _STYLES[kind]
        for name in (n for n in modules if name_matches(pattern, n)):
            if module_style is not None:
                styles[name] = module_style()
        for name in (n for n in params if name_matches(pattern, n)):
            if param_placement is None:
                continue
            owner, _, pname = name.rpartition(".")
            if owner in modules:  # a root-level parameter has no module to hook: left out
                shards.setdefault(owner, {})[pname] = param_placement(params[name].ndim)
    for owner, placements in shards.items():
        if owner in styles:
            raise ShardingError(
                f"hf_plan: the plan gives module {owner!r} the style {styles[owner]!r} and "
                f"its parameters {sorted(placements)} placements of their own; give one "
                "or the other.")
        styles[owner] = ShardParameters(placements)
    return styles


def gather_on_save(module: nn.Module) -> None:
    """Make ``module.save_pretrained(d, ...)`` (transformers') write global values: it
    first gathers every shardwise Tensor of the state dict it saves (the model's own, or
    the ``state_dict=`` given) into a plain tensor, tied weights into one
    (:func:`shardwise.checkpoint.full_state_dict`'s rule), then runs transformers' own
    ``save_pretrained``. Under torchrun every rank calls it (the gather is a collective)
    and rank 0 writes, as transformers does for DTensors. ``parallelize_module`` and
    ``fully_shard`` call this on the module they are given; a module without a
    ``save_pretrained`` that takes ``state_dict`` is left alone. The wrapper is an
    attribute of this instance (``copy.deepcopy`` rebinds it to the copy).

    >>> class Saver(torch.nn.Linear):
    ...     def save_pretrained(self, d: str, state_dict: dict | None = None) -> None:
    ...         print(d, {k: type(v).__name__ for k, v in state_dict.items()})
    >>> m = Saver(4, 2)
    >>> m.weight = torch.nn.Parameter(shardwise.tensor(
    ...     m.weight.detach(), sharding=PlacementMapping(DeviceMesh.cpu(2, "tp"), [Sharded(0)])))
    >>> gather_on_save(m)
    >>> m.save_pretrained("out")
    out {'weight': 'Tensor', 'bias': 'Tensor'}
    >>> isinstance(m.weight, shardwise.Tensor)  # the model itself is unchanged
    True
    """
    save = getattr(type(module), "save_pretrained", None)
    if not callable(save) or "save_pretrained" in vars(module):
        return
    try:
        takes = "state_dict" in inspect.signature(save).parameters
    except (TypeError, ValueError):  # a builtin without a signature: not transformers'
        return
    if takes:
        vars(module)["save_pretrained"] = types.MethodType(_save_gathered, module)


def _save_gathered(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """transformers' ``save_pretrained`` on the state dict with global values."""
    from shardwise.checkpoint.state import gather_values  # (torch.distributed.checkpoint)

    save: Any = type(self).save_pretrained  # type: ignore[attr-defined]
    bound = inspect.signature(save).bind(self, *args, **kwargs)
    given = bound.arguments.get("state_dict")
    bound.arguments["state_dict"] = gather_values(self.state_dict() if given is None
                                                  else given)
    return save(*bound.args, **bound.kwargs)
