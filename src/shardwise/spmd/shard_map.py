"""shard_map: per-device torch code on the local blocks of sharded values (JAX semantics).

``shard_map(fn, mesh, in_specs, out_specs)(*args)`` lays each argument out as its
in_spec, calls ``fn`` once per device on that device's local blocks (plain
``torch.Tensor``s; ``shardwise.lax`` collectives talk across devices by mesh-axis
name), and assembles the returned blocks into ``shardwise.Tensor``s laid out as
the out_specs.

Invariants:
- A spec is a tuple of per-dim entries (None, an axis name, or a tuple of names;
  dims past its end are not sharded), ``None`` or ``()`` for replicated, or any
  sharding form (PlacementMapping, NamedMapping, ShardingSpec). ``in_specs`` has
  one spec per positional argument; ``out_specs`` is one spec for a single output
  or one per output when fn returns a tuple/list. A sharding-form spec (or None)
  given alone applies to every argument/output.
- Output global shapes come from the returned blocks: sharded dims concatenate,
  and must follow the split rule (piece k of g over n has g // n + (1 if k < g %
  n else 0)); other dims must agree.
- Mesh axes an out_spec does not name are replicated. As in JAX, fn must return
  equal values along them; shardwise takes coordinate 0's block
  (``check_replicated=True`` checks the others are close to it).
- Gradients are those of the global computation, on both runtimes: a replicated
  input is one value every device uses (its gradient sums theirs); a replicated
  output is coordinate 0's block (the other devices' blocks get no gradient).
- fn must not modify its inputs in place (they share memory with the caller's
  values and, simulated, with other devices' blocks): a write to an input block
  raises before anything is written (``shard_map_guard``), so the caller's
  tensors are intact after the error.

On ``DeviceMesh(dp=2, tp=2)``, ``shard_map(f, mesh, in_specs=(("dp", None),),
out_specs=("dp", None))(x)`` for a 4-row ``x``::

    device (dp,tp)   (0,0)       (0,1)       (1,0)       (1,1)
    fn gets          x[0:2]      x[0:2]      x[2:4]      x[2:4]
    output block     f(x[0:2])   (ignored)   f(x[2:4])   (ignored)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.runtime import backend_for, spmd
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh, current_mesh
from shardwise.spmd import guard, io
from shardwise.tensors.tensor import Tensor, place

__all__ = ["shard_map"]

_MISSING: Any = type("_Missing", (), {"__repr__": lambda self: "<missing>"})()


def shard_map(fn: Callable[..., Any] | None = None, mesh: DeviceMesh | None = None,
              in_specs: Any = _MISSING, out_specs: Any = _MISSING, *,
              check_replicated: bool = False, timeout_s: float | None = None,
              check_writes: bool = True, out_shapes: Any = None) -> Any:
    """``fn`` mapped over the devices of ``mesh``: returns a function of the global
    arguments (shardwise Tensors, torch tensors or data) that gives shardwise Tensors.

    Args:
        fn: plain torch code on local blocks; may call ``shardwise.lax`` collectives.
        mesh: the mesh (default: the one entered with ``with mesh:``).
        in_specs: one spec per positional argument (see the module doc).
        out_specs: the spec of fn's single output, or one per output.
        check_replicated: check that outputs agree along the mesh axes their spec
            leaves replicated (costs one comparison, or collective, per output).
        timeout_s: simulated runtime: how long devices wait for each other at a
            collective before giving up (default ``runtime.spmd.DEFAULT_TIMEOUT_S``,
            ``distributed.initialize``'s default).
        check_writes: stop fn before it writes to an input block (one Python call per
            torch op in fn; ``False`` still reports such a write, but only after it).
        out_shapes: the outputs' global shapes, where the caller knows them (one shape,
            or one per output, None for unknown): on the multi-process runtime the block
            shapes are then not exchanged (one collective and one host read fewer per
            call); each block is checked against its shape.

    >>> from shardwise import lax
    >>> mesh = DeviceMesh.cpu(4, "x")
    >>> def f(a, w):                                  # a: this device's rows, w: all of w
    ...     return lax.psum((a @ w).sum(0), "x")
    >>> x, w = torch.ones(8, 3), torch.ones(3, 2)
    >>> y = shard_map(f, mesh, in_specs=(("x", None), None), out_specs=None)(x, w)
    >>> y.to_torch().tolist()                         # (x @ w).sum(0), summed over devices
    [24.0, 24.0]

    Can be used as a decorator: ``@shard_map(mesh=mesh, in_specs=..., out_specs=...)``.
    """
    if fn is None:
        return functools.partial(shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_replicated=check_replicated, timeout_s=timeout_s,
                                 check_writes=check_writes, out_shapes=out_shapes)
    if not callable(fn):
        raise ShardingTypeError(f"shard_map needs a function fn. Got {fn!r}.")
    mesh = mesh if mesh is not None else current_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise ShardingError(
            f"shard_map needs a DeviceMesh: pass mesh= or call it inside `with mesh:`. "
            f"Got {mesh!r}."
        )
    if in_specs is _MISSING or out_specs is _MISSING:
        raise ShardingError(
            "shard_map needs in_specs (one spec per argument) and out_specs (one spec per "
            f"output). Got in_specs={in_specs!r}, out_specs={out_specs!r}. {io.HINT}"
        )
    io.check_names(in_specs, mesh, "in_specs")
    io.check_names(out_specs, mesh, "out_specs")
    if timeout_s is None:
        timeout_s = spmd.DEFAULT_TIMEOUT_S
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ShardingTypeError(f"shard_map timeout_s must be a number of seconds. Got "
                                f"{timeout_s!r} ({type(timeout_s).__name__}).")
    if not timeout_s > 0:
        raise ShardingError(f"shard_map timeout_s must be > 0 seconds. Got {timeout_s!r}.")

    @functools.wraps(fn)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise ShardingTypeError(
                f"A shard_map'd function takes positional arguments only (each gets an "
                f"in_spec). Got keywords {sorted(kwargs)}; bind them with functools.partial."
            )
        return _call(fn, mesh, in_specs, out_specs, args, check_replicated, float(timeout_s),
                     check_writes, out_shapes)

    return mapped


# --- inputs ---------------------------------------------------------------------------------
def _inputs(mesh: DeviceMesh, in_specs: Any, args: Sequence[Any]) -> list[Tensor]:
    if io.is_leaf(in_specs):
        specs = [in_specs] * len(args)
    elif isinstance(in_specs, (tuple, list)):
        specs = list(in_specs)
        if len(specs) != len(args):
            raise ShardingError(
                f"shard_map got {len(args)} argument(s) but in_specs has {len(specs)} "
                f"spec(s): {in_specs!r}. Give one spec per positional argument, e.g. "
                "in_specs=(('x', None),) for one argument split over 'x' on dim 0."
            )
    else:
        raise ShardingTypeError(f"in_specs is {in_specs!r} ({type(in_specs).__name__}): give "
                                f"a tuple with one spec per argument. {io.HINT}")
    placed = []
    for i, (x, spec) in enumerate(zip(args, specs)):
        if isinstance(x, Tensor):
            from shardwise.api.communication import shard

            layout = io.layout_of(spec, x.ndim, mesh, f"in_specs[{i}]")
            placed.append(shard(x, dim_specs=layout))
            continue
        if not isinstance(x, torch.Tensor):
            try:
                x = torch.as_tensor(x)
            except (TypeError, ValueError, RuntimeError) as err:
                raise ShardingTypeError(
                    f"shard_map argument {i} is a {type(x).__name__}, not a tensor ({err}). "
                    "Pass shardwise Tensors, torch tensors or array data."
                ) from None
        layout = io.layout_of(spec, x.ndim, mesh, f"in_specs[{i}]")
        # Replicated first, then the planner's local slices: differentiable, and on
        # every process the gradient comes back whole.
        placed.append(place(x, Layout.replicated(mesh, x.ndim)).relayout(layout))
    return placed


def _versions(placed: Sequence[Tensor]) -> list[tuple[int, torch.Tensor, int]]:
    out = {}
    for i, t in enumerate(placed):
        for s in t.shards:
            if s is not None and not s.is_inference():
                out[id(s)] = (i, s, s._version)
    return list(out.values())


def _check_unmodified(versions: Sequence[tuple[int, torch.Tensor, int]]) -> None:
    for i, s, v in versions:
        if s._version != v:
            raise ShardingError(
                f"shard_map: fn modified argument {i}'s local block in place. Blocks share "
                "memory with the caller's values (and, on the simulated runtime, with other "
                "devices' blocks), so fn must not write to them: use out-of-place ops "
                "(x = x + 1, not x += 1) or clone first."
            )


# --- running ------------------------------------------------------------------------------
def _call(fn: Callable[..., Any], mesh: DeviceMesh, in_specs: Any, out_specs: Any,
          args: Sequence[Any], check: bool, timeout_s: float, check_writes: bool,
          out_shapes: Any = None) -> Any:
    if spmd.current_env() is not None:
        raise ShardingError(
            "shard_map was called inside the fn of another shard_map: nesting is not "
            "supported. Call the inner function directly on the local blocks."
        )
    placed = _inputs(mesh, in_specs, args)
    versions = _versions(placed)
    protected = (guard.storages((i, s) for i, t in enumerate(placed) for s in t.shards)
                 if check_writes else {})
    results, k = backend_for(mesh).run_spmd(
        guard.guarded(fn, protected), mesh, [(t.shards, t.dist_layout) for t in placed],
        timeout_s)
    _check_unmodified(versions)
    return io.outputs(results, k, mesh, out_specs, check, out_shapes)
