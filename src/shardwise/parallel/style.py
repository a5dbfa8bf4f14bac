"""Parallel styles: how one module is laid out over the plan's mesh axis (DTensor's names).

A style shards the module's parameters and installs forward hooks that lay its
inputs and outputs out on that axis. Values are global (a shardwise Tensor has the
global shape), so the module's own code runs unchanged: attention keeps
``view(b, t, heads, d // heads)`` with the global head count, and sharding
propagation keeps the heads sharded.

Invariants:
- Layouts name one placement for the plan's mesh axis: ``Replicated()``,
  ``Sharded(dim)`` or ``Partial()``; the other mesh axes keep what the value has.
- Column-parallel (``ColwiseParallel``): Linear weight ``Sharded(0)`` (out
  features) and bias ``Sharded(0)``, Embedding table ``Sharded(1)``; input
  Replicated; output ``Sharded(-1)`` unless ``output_layouts`` says otherwise.
- Row-parallel (``RowwiseParallel``): Linear weight ``Sharded(1)``, bias
  Replicated, input ``Sharded(-1)``; Embedding table ``Sharded(0)`` (vocabulary),
  input Replicated. The result is Partial on the axis and is reduced at the
  module's boundary to ``output_layouts`` (default Replicated: one all_reduce;
  ``Sharded(1)``: one reduce_scatter, as with sequence parallelism).
- transformers' ``Conv1D`` (weight ``[in, out]``, a transposed Linear) is a Linear
  with its weight's dims swapped: Colwise ``Sharded(1)``, Rowwise ``Sharded(0)``.
  It is recognised by class name and weight shape (transformers is never imported).
- ``SequenceParallel``: parameters Replicated, activations ``Sharded(sequence_dim)``.
- Plain ``torch.Tensor`` inputs are global values: placed (no communication),
  never read as local shards; ``input_layouts`` say how to place them where no
  desired layout is given.
- Each style runs its module's forward (hooks included) at the program position
  "module path (style kind)" (:mod:`shardwise.runtime.position`): the collectives it
  causes carry it, so ranks that lay a module out differently disagree at their first
  collective there.
- ``use_local_output=True`` is refused: it exists in DTensor for model code written
  for local shapes, which global values make unnecessary.

Module-level hooks of a 2-layer MLP on ``DeviceMesh(tp=2)`` (Megatron)::

    module   style      weight        input          output
    w1       Colwise    S(0) [h/2,d]  R  (x)         S(-1)  (no communication)
    w2       Rowwise    S(1) [d,h/2]  S(-1)          P -> R (one all_reduce)
"""

from __future__ import annotations

import abc
import types
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from shardwise.parallel import replicas
from shardwise.parallel.blocks import vocab_embedding
from shardwise.parallel.placing import check_placement, home_of, place_on, shard_parameter
from shardwise.runtime import position
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Placement, Replicated, Sharded
from shardwise.tensors.traced import traced

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleOutput",
           "RowwiseParallel", "SequenceParallel"]

Layouts = Placement | tuple[Placement | None, ...] | None


def _no_local_output(use_local_output: bool, style: str) -> None:
    if use_local_output:
        raise ShardingError(
            f"{style}(use_local_output=True) hands model code the local shards, for code "
            "written with local shapes (DTensor's escape hatch). A shardwise Tensor has the "
            "global shape, so the model code runs unchanged on it: drop use_local_output. "
            "For per-device code use shardwise.shard_map.")


def _tuple(value: Layouts, what: str) -> tuple[Placement | None, ...] | None:
    if value is None:
        return None
    items = value if isinstance(value, (tuple, list)) else (value,)
    return tuple(check_placement(v, what) for v in items)


def _kwargs(value: Mapping[str, Placement | None] | None, what: str
            ) -> dict[str, Placement | None]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ShardingTypeError(f"{what} takes a dict of argument name -> placement. "
                                f"Got {value!r}.")
    return {k: check_placement(v, f"{what}[{k!r}]") for k, v in value.items()}


class ParallelStyle(abc.ABC):
    """A way to lay one module out over the plan's mesh axis; see the module doc.

    Subclasses implement :meth:`apply`, which ``parallelize_module`` calls once per
    matched module with the mesh, the index of the plan's mesh axis and the
    module's name (for error messages).
    """

    @abc.abstractmethod
    def apply(self, module: nn.Module, mesh: DeviceMesh, axis: int, name: str) -> None:
        """Shard ``module``'s parameters and install its hooks (in place)."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if v is not None
                           and k != "use_local_output")
        return f"{type(self).__name__}({fields})"


def _hook_inputs(module: nn.Module, mesh: DeviceMesh, axis: int,
                 desired: tuple[Placement | None, ...] | None,
                 plain: tuple[Placement | None, ...] | None,
                 kw_desired: Mapping[str, Placement | None],
                 kw_plain: Mapping[str, Placement | None], every: Placement | None = None
                 ) -> None:
    """Lay positional input ``i`` out as ``desired[i]`` (plain tensors: placed as
    ``desired[i]`` or ``plain[i]``); ``every``: the layout of every positional input."""

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        home, a = home_of(mod, mesh, axis)  # a pipeline stage's slice, once restricted
        out = []
        for i, x in enumerate(args):
            want = every if every is not None else (
                desired[i] if desired is not None and i < len(desired) else None)
            given = plain[i] if plain is not None and i < len(plain) else None
            out.append(place_on(x, home, a, want, given, where=f"input {i}"))
        kw = dict(kwargs)
        for k in set(kw_desired) | set(kw_plain):
            if k in kw:
                kw[k] = place_on(kw[k], home, a, kw_desired.get(k), kw_plain.get(k),
                                 where=f"input {k!r}")
        return tuple(out), kw

    module.register_forward_pre_hook(traced(hook), with_kwargs=True)  # one graph node


def _hook_outputs(module: nn.Module, mesh: DeviceMesh, axis: int,
                  desired: tuple[Placement | None, ...]) -> None:
    """Lay output ``i`` (of a tuple, or the single output) out as ``desired[i]``."""

    def hook(mod: nn.Module, args: Any, output: Any) -> Any:
        home, a = home_of(mod, mesh, axis)
        if isinstance(output, tuple):
            return tuple(place_on(o, home, a, desired[i] if i < len(desired) else None,
                                  where=f"output {i}") for i, o in enumerate(output))
        return place_on(output, home, a, desired[0], where="output")

    module.register_forward_hook(traced(hook))  # one graph node


def mark(module: nn.Module, mesh: DeviceMesh, name: str, style: str) -> None:
    """Run ``module``'s forward (its hooks included) at program position ``name``
    (``style``): the collectives it causes carry it. Call last in ``apply`` (the leaving
    hook must follow the output hook); it also runs when the forward raises. With the
    replica check on, the module's plain tensor inputs are recorded for it."""
    here = position.site(name, style)

    def enter(mod: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # a compiled graph runs no agreement
            return
        position.push(here)
        if replicas.ENABLED is not None:
            replicas.record_inputs(name, mesh, args)

    def leave(mod: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        position.pop()

    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(leave, always_call=True)


def _kind(module: nn.Module, style: str, name: str) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if _is_conv1d(module):
        return "conv1d"
    raise ShardingError(
        f"{style} shards nn.Linear, nn.Embedding and transformers' Conv1D modules; "
        f"{name or 'the module'!r} is a {type(module).__name__}. Use SequenceParallel() for "
        "norms and dropout, or PrepareModuleInput/PrepareModuleOutput to lay out another "
        "module's inputs.")


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a Linear whose weight is stored transposed,
    ``[in (nx), out (nf)]``. Found by duck typing: shardwise never imports transformers."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == (getattr(module, "nx", None),
                                        getattr(module, "nf", None)))


class ColwiseParallel(ParallelStyle):
    """Column-parallel ``nn.Linear`` (weight rows = output features sharded) or
    ``nn.Embedding`` (embedding dim sharded): input Replicated, output ``Sharded(-1)``
    (or ``output_layouts``), no communication inside.

    >>> from shardwise.parallel import parallelize_module
    >>> mesh = DeviceMesh.cpu(2, "tp")
    >>> lin = parallelize_module(torch.nn.Linear(4, 6), mesh, ColwiseParallel())
    >>> lin.weight.placements, lin(torch.ones(3, 4)).placements
    ((Sharded(axis=0),), (Sharded(axis=1),))
    """

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = False
                 ) -> None:
        _no_local_output(use_local_output, "ColwiseParallel")
        self.input_layouts = check_placement(input_layouts, "ColwiseParallel(input_layouts)")
        self.output_layouts = check_placement(output_layouts,
                                              "ColwiseParallel(output_layouts)")
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, mesh: DeviceMesh, axis: int, name: str) -> None:
        kind = _kind(module, "ColwiseParallel", name)
        if kind != "embedding":  # the output features: Linear's rows, Conv1D's columns
            shard_parameter(module, "weight", mesh, axis, Sharded(0 if kind == "linear" else 1))
            shard_parameter(module, "bias", mesh, axis, Sharded(0))
        else:
            shard_parameter(module, "weight", mesh, axis, Sharded(1))
        _hook_inputs(module, mesh, axis, (Replicated(),), (self.input_layouts,), {}, {})
        _hook_outputs(module, mesh, axis, (self.output_layouts or Sharded(-1),))
        mark(module, mesh, name, f"ColwiseParallel {kind}")


class RowwiseParallel(ParallelStyle):
    """Row-parallel ``nn.Linear`` (weight columns = input features sharded, input
    ``Sharded(-1)``) or ``nn.Embedding`` (vocabulary sharded, ids Replicated): the
    result is Partial on the axis and is reduced at the boundary to ``output_layouts``
    (default Replicated: one all_reduce; ``Sharded(1)``: one reduce_scatter).

    >>> from shardwise.parallel import parallelize_module
    >>> mesh = DeviceMesh.cpu(2, "tp")
    >>> lin = parallelize_module(torch.nn.Linear(6, 4), mesh, RowwiseParallel())
    >>> x = shardwise.tensor(torch.ones(3, 6), sharding=PlacementMapping(mesh, [Sharded(1)]))
    >>> lin.weight.placements, lin(x).placements
    ((Sharded(axis=1),), (Replicated(),))
    """

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = False
                 ) -> None:
        _no_local_output(use_local_output, "RowwiseParallel")
        self.input_layouts = check_placement(input_layouts, "RowwiseParallel(input_layouts)")
        self.output_layouts = check_placement(output_layouts,
                                              "RowwiseParallel(output_layouts)")
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, mesh: DeviceMesh, axis: int, name: str) -> None:
        kind = _kind(module, "RowwiseParallel", name)
        if kind != "embedding":  # the input features: Linear's columns, Conv1D's rows
            shard_parameter(module, "weight", mesh, axis, Sharded(1 if kind == "linear" else 0))
            shard_parameter(module, "bias", mesh, axis, Replicated())
            want: Placement = Sharded(-1)
        else:
            emb = module
            assert isinstance(emb, nn.Embedding)
            if emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
                raise ShardingError(
                    f"RowwiseParallel on embedding {name!r}: max_norm, sparse and "
                    "scale_grad_by_freq are not supported with a vocabulary-sharded table. "
                    "Use ColwiseParallel() (embedding dim sharded) for this module.")
            shard_parameter(module, "weight", mesh, axis, Sharded(0))
            emb.forward = types.MethodType(_vocab_forward, emb)  # type: ignore[method-assign]
            want = Replicated()
        _hook_inputs(module, mesh, axis, (want,), (self.input_layouts,), {}, {})
        _hook_outputs(module, mesh, axis, (self.output_layouts or Replicated(),))
        mark(module, mesh, name, f"RowwiseParallel {kind}")


def _vocab_forward(self: nn.Embedding, ids: Any) -> Any:
    """nn.Embedding.forward over a vocabulary-sharded table (the input hook placed
    ``ids`` on the mesh): a Partial(SUM) lookup, reduced by the output hook."""
    if self.padding_idx is None:  # (a compiled node's arguments hold no None)
        return _vocab_lookup(ids, self.weight)
    return _vocab_lookup(ids, self.weight, self.padding_idx)


#: the lookup as one node of a compiled graph (its per-block Python would break it)
_vocab_lookup = traced(vocab_embedding)


class SequenceParallel(ParallelStyle):
    """Sequence parallelism for modules that act per position (LayerNorm, RMSNorm,
    dropout): parameters Replicated, inputs and output ``Sharded(sequence_dim)``.

    >>> from shardwise.parallel import parallelize_module
    >>> mesh = DeviceMesh.cpu(2, "tp")
    >>> ln = parallelize_module(torch.nn.LayerNorm(4), mesh, SequenceParallel())
    >>> ln.weight.placements, ln(torch.ones(2, 6, 4)).placements
    ((Replicated(),), (Sharded(axis=1),))
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        _no_local_output(use_local_output, "SequenceParallel")
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
            raise ShardingTypeError(f"SequenceParallel(sequence_dim) is an int tensor dim. "
                                    f"Got {sequence_dim!r}; use e.g. sequence_dim=1.")
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, mesh: DeviceMesh, axis: int, name: str) -> None:
        for sub in module.modules():
            for pname in list(sub._parameters):
                shard_parameter(sub, pname, mesh, axis, Replicated())
        seq = Sharded(self.sequence_dim)
        _hook_inputs(module, mesh, axis, None, None, {}, {}, every=seq)
        _hook_outputs(module, mesh, axis, (seq,))
        mark(module, mesh, name, "SequenceParallel")


class PrepareModuleInput(ParallelStyle):
    """Lay a module's inputs out before its forward: positional input ``i`` (or keyword
    input ``k``) moves to ``desired_input_layouts[i]`` (``desired_input_kwarg_layouts[k]``);
    ``input_layouts`` tell how to place plain tensors where no desired layout is given.
    ``None`` entries leave an input alone.

    >>> from shardwise.parallel import parallelize_module
    >>> mesh = DeviceMesh.cpu(2, "tp")
    >>> x = shardwise.tensor(torch.ones(2, 6, 4), sharding=PlacementMapping(mesh, [Sharded(1)]))
    >>> m = parallelize_module(torch.nn.Identity(), mesh, PrepareModuleInput(
    ...     input_layouts=Sharded(1), desired_input_layouts=Replicated()))
    >>> m(x).placements          # one all_gather
    (Replicated(),)
    """

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: Mapping[str, Placement | None] | None = None,
                 desired_input_kwarg_layouts: Mapping[str, Placement | None] | None = None,
                 use_local_output: bool = False) -> None:
        _no_local_output(use_local_output, "PrepareModuleInput")
        self.input_layouts = _tuple(input_layouts, "PrepareModuleInput(input_layouts)")
        self.desired_input_layouts = _tuple(desired_input_layouts,
                                            "PrepareModuleInput(desired_input_layouts)")
        if (self.input_layouts is not None and self.desired_input_layouts is not None
                and len(self.input_layouts) != len(self.desired_input_layouts)):
            raise ShardingError(
                f"PrepareModuleInput: input_layouts {list(self.input_layouts)} and "
                f"desired_input_layouts {list(self.desired_input_layouts)} need one entry "
                "per positional input each. Give both the same length (None to skip one).")
        self.input_kwarg_layouts = _kwargs(input_kwarg_layouts, "input_kwarg_layouts")
        self.desired_input_kwarg_layouts = _kwargs(desired_input_kwarg_layouts,
                                                   "desired_input_kwarg_layouts")
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, mesh: DeviceMesh, axis: int, name: str) -> None:
        _hook_inputs(module, mesh, axis, self.desired_input_layouts, self.input_layouts,
                     self.desired_input_kwarg_layouts, self.input_kwarg_layouts)
        mark(module, mesh, name, "PrepareModuleInput")


class PrepareModuleOutput(ParallelStyle):
    """Lay a module's outputs out after its forward: output ``i`` moves to
    ``desired_output_layouts[i]`` (``output_layouts`` are what the outputs hold; with
    global values they need no declaring and are only checked for their form).

    >>> from shardwise.parallel import parallelize_module
    >>> mesh = DeviceMesh.cpu(2, "tp")
    >>> m = parallelize_module(torch.nn.Identity(), mesh, PrepareModuleOutput(
    ...     output_layouts=Replicated(), desired_output_layouts=Sharded(0)))
    >>> m(torch.ones(4, 2)).placements
    (Sharded(axis=0),)
    """

    def __init__(self, *, output_layouts: Layouts = None, desired_output_layouts: Layouts,
                 use_local_output: bool = False) -> None:
        _no_local_output(use_local_output, "PrepareModuleOutput")
        self.output_layouts = _tuple(output_layouts, "PrepareModuleOutput(output_layouts)")
        desired = _tuple(desired_output_layouts, "PrepareModuleOutput(desired_output_layouts)")
        if desired is None:
            raise ShardingError("PrepareModuleOutput needs desired_output_layouts (one "
                                "placement per output). Got None.")
        if self.output_layouts is not None and len(self.output_layouts) != len(desired):
            raise ShardingError(
                f"PrepareModuleOutput: output_layouts {list(self.output_layouts)} and "
                f"desired_output_layouts {list(desired)} need one entry per output each.")
        self.desired_output_layouts = desired
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, mesh: DeviceMesh, axis: int, name: str) -> None:
        _hook_outputs(module, mesh, axis, self.desired_output_layouts)
        mark(module, mesh, name, "PrepareModuleOutput")

