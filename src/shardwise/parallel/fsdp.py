"""``fully_shard``: fully sharded data parallelism (ZeRO-3) with FSDP2's names and
semantics, on shardwise Tensors (global values: a parameter keeps its global shape).

Invariants:
- ``fully_shard(block)`` then ``fully_shard(root)``: each call is one *unit* managing
  the parameters of its module that no inner call manages; calling it twice on one
  module is an error.
- Between forwards every managed parameter is an ``nn.Parameter`` over a shardwise
  Tensor Sharded over ``axis`` in addition to its own layout (tensor-parallel
  parameters keep their axis, ``axis`` is added as the minor axis of the dim);
  ``parameters()``, ``state_dict()`` (original names) and the optimizer see only
  these. During a unit's forward its modules hold the gathered values.
- A unit's forward (its gather included) runs at the program position "its path from
  the outermost ``fully_shard`` root (fully_shard)" (:mod:`shardwise.runtime.position`),
  and its gradient reduction at the backward of it: their collectives carry it.
- On a mesh this process holds wholly (the simulated runtime) a sharded parameter
  holds its global value, its blocks views of it, as ``shardwise.tensor`` makes them:
  gathering is then a view, and the optimizer's ops run once on the whole value.
- Gathering, gradient reduction and resharding are in
  :mod:`shardwise.parallel.fsdp_unit` (see its invariants).
- Under ``torch.compile`` the unit's hooks are skipped (``tensors.traced.eager_only``):
  the parameters stay sharded in the graph and each op relayouts them as it needs (the
  planner's all_gathers; their gradients' reductions in the backward graph), so values,
  gradients and optimizer steps equal eager; a unit with a casting ``mp_policy`` runs
  its casts as graph ops instead (``precision.compiled_hooks``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from shardwise.parallel import replicas
from shardwise.parallel.fsdp_unit import UNIT, Param, Unit, sharded_layout
from shardwise.parallel.hf import gather_on_save
from shardwise.parallel.precision import MixedPrecisionPolicy, cast_floating, compiled_hooks
from shardwise.runtime import holds_whole, position
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.shapes import local_shape
from shardwise.tensors.tensor import Tensor, place
from shardwise.tensors.traced import eager_only

__all__ = ["MixedPrecisionPolicy", "fully_shard", "memory_per_device"]

#: the default policy: parameters gathered and gradients reduced in their own dtype
NO_CAST = MixedPrecisionPolicy()


def fully_shard(module: nn.Module, mesh: DeviceMesh, axis: str = "dp", *,
                reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy = NO_CAST,
                ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """Shard ``module``'s parameters over mesh axis ``axis`` (ZeRO-3 / FSDP2).

    Every parameter not managed by an inner ``fully_shard`` call becomes Sharded over
    ``axis`` (dim 0, as FSDP2; a parameter already sharded on another axis of ``mesh``,
    e.g. by tensor parallelism, keeps that axis). Before ``module``'s forward the
    parameters are gathered over ``axis`` (one all_gather for the whole unit, in
    ``mp_policy.param_dtype``), and their gradients come back reduce-scattered in the
    sharded layout (one reduce_scatter, in ``mp_policy.reduce_dtype``), so a stock
    optimizer keeps sharded state. With ``reshard_after_forward`` the gathered values
    are freed after forward and gathered again in backward; otherwise autograd keeps
    them until backward.

    Args:
        module: the module to shard (returned, changed in place; a transformers
            model's ``save_pretrained`` then writes global values,
            :func:`~shardwise.parallel.hf.gather_on_save`).
        mesh: the device mesh; tensor-parallel parameters must already live on it.
        axis: the mesh axis to shard over (the data-parallel axis).
        reshard_after_forward: free gathered parameters after forward (ZeRO-3) or
            keep them for backward (ZeRO-2-like memory, one all_gather fewer).
        mp_policy: dtypes of the gathered parameters and of the gradient reduction.
        ignored_params: parameters this unit leaves as they are (FSDP2's name): neither
            sharded nor gathered, their gradients as autograd gives them; e.g. the
            experts of ``ExpertParallel`` over ``dp`` (dp2ep), already sharded there.

    Returns:
        ``module``, whose parameters are now sharded.

    >>> import torch.nn as nn
    >>> mesh = DeviceMesh.cpu(2, "dp")
    >>> model = fully_shard(nn.Linear(4, 3), mesh)
    >>> model.weight.placements, [tuple(s.shape) for s in model.weight.shards]
    ((Sharded(axis=0),), [(2, 4), (1, 4)])
    >>> x = shardwise.tensor(torch.ones(2, 4), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> model(x).sum().backward()
    >>> model.weight.grad.dist_layout == model.weight.dist_layout
    True
    """
    if not isinstance(module, nn.Module):
        raise ShardingTypeError(
            f"fully_shard needs an nn.Module. Got {type(module).__name__}. Pass the model "
            "or one of its blocks.")
    if not isinstance(mesh, DeviceMesh):
        raise ShardingTypeError(
            f"fully_shard(mesh=...) needs a DeviceMesh. Got {type(mesh).__name__}. Build "
            "one with DeviceMesh.cpu((2, 2), ('dp', 'tp')).")
    if axis not in mesh.axis_names:
        raise ShardingError(
            f"fully_shard(axis={axis!r}): {mesh!r} has no axis {axis!r}; the FSDP axis must "
            f"be one of the mesh's axes {mesh.axis_names}. Use axis={mesh.axis_names[0]!r} "
            "or name the mesh's data-parallel axis.")
    if not isinstance(reshard_after_forward, bool):
        raise ShardingTypeError(
            f"fully_shard(reshard_after_forward=...) needs a bool. Got "
            f"{reshard_after_forward!r}. Use True (free after forward) or False.")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ShardingTypeError(
            f"fully_shard(mp_policy=...) needs a MixedPrecisionPolicy. Got {mp_policy!r}. "
            "Use MixedPrecisionPolicy(param_dtype=torch.bfloat16).")
    if getattr(module, UNIT, None) is not None:
        raise ShardingError(
            f"fully_shard was already called on this {type(module).__name__}: a module is "
            "one unit. Call fully_shard once per module (inner blocks first, then the root).")
    if ignored_params is not None and not (
            isinstance(ignored_params, (set, frozenset))
            and all(isinstance(p, torch.Tensor) for p in ignored_params)):
        raise ShardingTypeError(
            f"fully_shard(ignored_params=...) is a set of parameters. Got "
            f"{ignored_params!r}; e.g. set(model.layers[0].moe.experts.parameters()).")
    a = mesh.axis_names.index(axis)
    ignored = {id(p) for p in ignored_params or ()}
    unit = Unit(module, mesh, a, _manage(module, mesh, a, ignored), reshard_after_forward,
                mp_policy)
    setattr(module, UNIT, unit)
    replicas.track(module)
    for path, sub in module.named_modules():  # inner units first: the root names them last
        inner = getattr(sub, UNIT, None)
        if inner is not None:
            inner.site = position.site(path, "fully_shard")
    # Compiled code skips the hooks: the graph's ops gather the sharded parameters
    # (relayouts to what each op needs, differentiated to their reductions); a policy
    # that casts runs its casts as graph ops instead
    before, after = (None, None) if mp_policy == NO_CAST else compiled_hooks(unit)
    module.register_forward_pre_hook(eager_only(_pre_forward, before), with_kwargs=True)
    module.register_forward_hook(eager_only(_post_forward, after), always_call=True)
    gather_on_save(module)  # a transformers model's save_pretrained writes global values
    return module


def _manage(module: nn.Module, mesh: DeviceMesh, axis: int, ignored: set[int]
            ) -> list[Param]:
    """Shard every parameter of ``module`` that no inner unit manages and ``ignored`` (ids)
    does not hold; where each parameter is registered (a parameter shared by two modules
    is sharded once)."""
    inner: set[int] = set(ignored)
    for sub in module.modules():
        unit = getattr(sub, UNIT, None)
        if unit is not None:
            inner.update(id(fp.sharded) for fp in unit.params)
    found: dict[int, Param] = {}
    for prefix, sub in module.named_modules():
        for name, p in sub._parameters.items():
            if p is None or id(p) in inner:
                continue
            fp = found.get(id(p))
            if fp is None:
                fp = found[id(p)] = _shard(p, f"{prefix}.{name}" if prefix else name,
                                           mesh, axis)
            fp.owners.append((sub, name))
    for fp in found.values():
        for owner, name in fp.owners:
            owner._parameters[name] = fp.sharded  # type: ignore[assignment]
    return list(found.values())


def _shard(p: torch.Tensor, name: str, mesh: DeviceMesh, axis: int) -> Param:
    """``p`` as an nn.Parameter Sharded over ``axis`` too (its blocks copied, so the
    whole value is not kept alive)."""
    axis_name = mesh.axis_names[axis]
    if isinstance(p, Tensor):
        if p.mesh != mesh:
            raise ShardingError(
                f"fully_shard: parameter {name!r} lives on {p.mesh!r}, not on {mesh!r}. "
                "Lay out tensor-parallel parameters on the mesh given to fully_shard.")
        here = p.dist_layout
        if here.is_partial:
            raise ShardingError(
                f"fully_shard: parameter {name!r} is Partial ({here}); a parameter must hold "
                "its value. Reduce it first with shardwise.all_reduce.")
        if axis in here.sharded_axes:
            raise ShardingError(
                f"fully_shard: parameter {name!r} is already sharded over {axis_name!r} "
                f"({here}); the FSDP axis must be free. Shard it over another axis, pass "
                "fully_shard another axis, or leave it out with ignored_params (the experts "
                "of ExpertParallel over dp).")
        value = p.detach()
    else:
        here = Layout.replicated(mesh, p.ndim)
        value = place(p.detach(), here)
    if p.ndim == 0:
        raise ShardingError(
            f"fully_shard: parameter {name!r} is 0-d, so it has no dim to shard over "
            f"{axis_name!r}. Give it shape (1,), or move it out of the module.")
    target, dim = sharded_layout(here, axis, tuple(p.shape))
    with torch.no_grad():
        if holds_whole(mesh):
            # a mesh this process holds wholly: the parameter keeps its global value
            # (blocks cut from it as views), so its gathers are copies of it and the
            # optimizer's ops run once on it, not once per block
            t = Tensor.from_whole(value.global_value().clone(), target)
        else:
            t = value.relayout(target).map_blocks(lambda s: s.clone())
    param = nn.Parameter(t, requires_grad=p.requires_grad)
    assert isinstance(param, Tensor)  # nn.Parameter keeps the subclass
    return Param([], param, here, dim)


def _pre_forward(module: nn.Module, args: Any, kwargs: Any) -> Any:
    unit: Unit = getattr(module, UNIT)
    position.push(unit.site)  # left in _post_forward (which runs also when forward raises)
    with position.issuing("all_gather parameters"):
        unit.unshard()
    policy = unit.policy
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        return cast_floating(args, policy.param_dtype), cast_floating(kwargs,
                                                                      policy.param_dtype)
    return args, kwargs


def _post_forward(module: nn.Module, args: Any, output: Any) -> Any:
    unit: Unit = getattr(module, UNIT)
    position.pop()
    unit.reshard_params()
    return cast_floating(output, unit.policy.output_dtype)


def memory_per_device(module: nn.Module, optimizer: torch.optim.Optimizer | None = None
                      ) -> list[int]:
    """Bytes each device of the parameters' mesh holds for ``module``'s parameters and
    ``optimizer``'s state: per device, the sum over distinct tensors of its local
    block's bytes (computed from the layout, so devices of other processes count too);
    a plain torch tensor counts whole on every device.

    >>> import torch.nn as nn
    >>> mesh = DeviceMesh.cpu(4, "dp")
    >>> model = fully_shard(nn.Linear(3, 5, bias=False), mesh)    # 15 floats, rows 2+1+1+1
    >>> memory_per_device(model)
    [24, 12, 12, 12]
    """
    tensors: dict[int, torch.Tensor] = {id(p): p for p in module.parameters()}
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    tensors.setdefault(id(v), v)
    meshes = {t.mesh for t in tensors.values() if isinstance(t, Tensor)}
    if len(meshes) != 1:
        raise ShardingError(
            f"memory_per_device needs the parameters on one mesh; found {len(meshes)} "
            f"({sorted(map(repr, meshes))}). Lay every parameter out on one DeviceMesh.")
    mesh = meshes.pop()
    out = [0] * mesh.num_devices
    for t in tensors.values():
        for k in range(mesh.num_devices):
            if isinstance(t, Tensor):
                n = 1
                for size in local_shape(tuple(t.shape), t.dist_layout, mesh.coord_of(k)):
                    n *= size
                out[k] += n * t.dtype.itemsize
            else:
                out[k] += t.numel() * t.element_size()
    return out
