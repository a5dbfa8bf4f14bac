"""Helpers for the compute-op tests in tests/ops and tests/propagation.

``run(fn_sw, fn_torch, inputs)`` runs a compute op on shardwise Tensors and the
same function on plain torch, and checks value (through the independent oracle
``shardcheck.global_of``), replica sharing, and gradients.

Every case runs both ways the runtime runs ops: on whole values (leaves made by
``.requires_grad_()`` on a Tensor holding its global value: the simulated runtime runs
each op once on the wholes) and on blocks (no mesh held wholly, as under torchrun:
every value held as blocks, leaves one per block, each op once per distinct block),
each checked on its own; both must count the same collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

import shardwise as sw
from shardwise.debug import CommCounter
from shardwise.runtime import local
from shardwise.sharding import DeviceMesh, Layout, ReduceOp
from tests.helpers.meshes import M4, M24
from tests.helpers.shardcheck import assert_shares_replicas, block, global_of, whole_value

# the compute tests' meshes, under the names they import from here
MESH = M24
LINE = M4


def lay(mesh: DeviceMesh, *dims: Any, partial: dict[str, ReduceOp] | None = None) -> Layout:
    """``lay(MESH, "dp", None, partial={"tp": SUM})``: per tensor dim None, an axis
    name or a tuple of names; Partial axes by name."""
    names = mesh.axis_names
    out = []
    for d in dims:
        d = () if d is None else (d,) if isinstance(d, str) else tuple(d)
        out.append(tuple(names.index(a) for a in d))
    ops = tuple((partial or {}).get(n) for n in names)
    return Layout(mesh, tuple(out), ops)


def show(t: sw.Tensor) -> str:
    """The layout without the mesh: ``[S(dp), R] partial tp:sum``."""
    return str(t.dist_layout)[len(repr(t.mesh)):]


def values(*shape: int, seed: int = 0, positive: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=gen, dtype=torch.float64)
    return v.abs() + 0.5 if positive else v


def make(value: torch.Tensor, layout: Layout, grad: bool = True, whole: bool = False
         ) -> sw.Tensor:
    """``value`` laid out as ``layout`` (``whole``: a leaf holding its global value).
    With Partial axes, every device holds an independent random block instead (the
    global value is then their reduction)."""
    grad = grad and value.is_floating_point()
    if not layout.is_partial:
        if whole:
            t = sw.tensor(value, sharding=layout)
            return t.requires_grad_() if grad else t
        return sw.tensor(value, sharding=layout, requires_grad=grad)
    mesh = layout.mesh
    gen = torch.Generator().manual_seed(value.numel())
    blocks = [torch.randn(block_shape(layout, value.shape, k), generator=gen,
                          dtype=value.dtype) for k in range(mesh.num_devices)]
    return sw.from_local(blocks, layout, value.shape, requires_grad=grad)


def block_shape(layout: Layout, shape: Sequence[int], k: int) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in block(layout.mesh, layout, shape, k))


@contextlib.contextmanager
def blocks_only() -> Iterator[None]:
    """Values and ops held and run as blocks, as in a process world: no mesh counts as
    held wholly here (the runtime's ``local_mesh``), so nothing is held whole."""
    real = local.local_mesh
    local.local_mesh = lambda mesh, device: False  # type: ignore[assignment]
    try:
        yield
    finally:
        local.local_mesh = real


def run(fn_sw: Callable[..., Any], fn_torch: Callable[..., torch.Tensor],
        inputs: Sequence[tuple[torch.Tensor, Layout] | Any], *, grad: bool = True,
        atol: float = 1e-9) -> tuple[sw.Tensor, CommCounter]:
    """``fn_sw`` on Tensors laid out as given vs ``fn_torch`` on the values, on both
    paths (leaves held as blocks, then whole: the module doc). Items of ``inputs`` that
    are not (value, layout) pairs are passed to both as constants. Returns the last
    run's result and counter."""
    with blocks_only():
        blocks = _run_once(fn_sw, fn_torch, inputs, grad, atol, whole=False)
    whole = _run_once(fn_sw, fn_torch, inputs, grad, atol, whole=True)
    assert dict(blocks[1].counts) == dict(whole[1].counts), (blocks[1], whole[1])
    return whole


def _run_once(fn_sw: Callable[..., Any], fn_torch: Callable[..., torch.Tensor],
              inputs: Sequence[tuple[torch.Tensor, Layout] | Any], grad: bool, atol: float,
              whole: bool) -> tuple[sw.Tensor, CommCounter]:
    ts: list[Any] = []
    refs: list[Any] = []
    for item in inputs:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Layout):
            value, layout = item
            t = make(value, layout, grad, whole)
            ts.append(t)
            value = global_of(t) if layout.is_partial else value
            refs.append(value.clone().requires_grad_(t.requires_grad))
        else:
            ts.append(item)
            refs.append(item)
    with CommCounter() as cc:
        out = fn_sw(*ts)
    if not whole:  # the blocks path: nothing held whole, the result included
        assert all(whole_value(t) is None for t in (*ts, out) if isinstance(t, sw.Tensor))
    expect = fn_torch(*refs)
    got = global_of(out)
    assert got.shape == expect.shape, (got.shape, expect.shape)
    assert got.dtype == expect.dtype, (got.dtype, expect.dtype)
    if expect.dtype == torch.bool:
        assert torch.equal(got, expect)
    else:
        assert torch.allclose(got, expect.detach(), atol=atol, equal_nan=True), (got, expect)
    assert_shares_replicas(out)
    if grad and expect.requires_grad:
        weight = values(*expect.shape, seed=7)
        (out.to_torch() * weight).sum().backward()
        (expect * weight).sum().backward()
        for t, r in zip(ts, refs):
            if isinstance(t, sw.Tensor) and t.requires_grad:
                assert t.grad is not None
                g = t.grad.to_torch()
                want = r.grad if r.grad is not None else torch.zeros_like(r)
                assert torch.allclose(g, want, atol=1e-7), (g, want)
    return out, cc
