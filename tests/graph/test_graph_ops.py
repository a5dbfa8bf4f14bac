"""Worked examples of the per-device graph ops (reference examples included),
new-value semantics and gradients."""

from __future__ import annotations

import pytest
import torch

import shardwise
import shardwise.graph
from shardwise.graph import Signals, ops
from shardwise.sharding.devices import CPU
from shardwise.tensors.tensor import Tensor

S2 = Signals([CPU(0), CPU(1)])


def on(data: object, i: int, **kw: object) -> Tensor:
    return shardwise.tensor(data, device=CPU(i), **kw)  # type: ignore[arg-type]


def values(outs: list[Tensor]) -> list[list[object]]:
    return [o.to_torch().tolist() for o in outs]


def test_namespace() -> None:
    assert shardwise.graph.ops is ops
    assert callable(ops.allreduce.sum) and callable(ops.reducescatter.sum)
    assert shardwise.eval_shape is shardwise.api.abstract.eval_shape
    assert "eval_shape" in shardwise.__all__


# --- allgather --------------------------------------------------------------------------
def test_allgather_uneven_axis0() -> None:
    x0, x1 = on([[1, 2]], 0), on([[3, 4], [5, 6]], 1)
    outs = ops.allgather([x0, x1], S2)
    assert [o.dist_device for o in outs] == [CPU(0), CPU(1)]
    assert values(outs) == [[[1, 2], [3, 4], [5, 6]]] * 2
    assert all(o.mesh.is_single and o.dtype == torch.int64 for o in outs)


@pytest.mark.parametrize("axis", [1, -1])
def test_allgather_axis1(axis: int) -> None:
    x0, x1 = on([[1], [2]], 0), on([[3, 4], [5, 6]], 1)
    assert values(ops.allgather([x0, x1], S2, axis=axis)) == [[[1, 3, 4], [2, 5, 6]]] * 2


def test_allgather_three_devices_follows_buffer_order() -> None:
    signals = Signals([CPU(2), CPU(0), CPU(1)])
    xs = [on([10 * i], i) for i in (2, 0, 1)]
    outs = ops.allgather(xs, signals)
    assert [o.dist_device for o in outs] == [CPU(2), CPU(0), CPU(1)]
    assert values(outs) == [[20, 0, 10]] * 3


def test_allgather_zero_size_input() -> None:
    x0, x1 = on(torch.zeros(0, 2), 0), on([[1.0, 2.0]], 1)
    assert values(ops.allgather([x0, x1], S2)) == [[[1.0, 2.0]]] * 2


# --- distributed_broadcast ------------------------------------------------------------
def test_distributed_broadcast_from_a_non_first_root() -> None:
    x = on([[1.0, 2.0]], 1)
    signals = Signals([CPU(0), CPU(1), CPU(2)])
    outs = ops.distributed_broadcast(x, signals)
    assert [o.dist_device for o in outs] == [CPU(0), CPU(1), CPU(2)]
    assert values(outs) == [[[1.0, 2.0]]] * 3
    assert all(o.shape == x.shape and o.dtype == x.dtype for o in outs)


# --- transfer_to --------------------------------------------------------------------------
def test_transfer_to() -> None:
    x = on([1, 2, 3], 0)
    y = ops.transfer_to(x, CPU(3))
    assert isinstance(y, Tensor) and y.dist_device == CPU(3)
    assert y.to_torch().tolist() == [1, 2, 3]
    z = ops.transfer_to(x, CPU(0))
    assert z is not x and z.dist_device == CPU(0)


# --- shard_and_stack (reference examples) ----------------------------------------------------
def test_shard_and_stack_reference_axis0() -> None:
    d = 3
    a = torch.arange(10 * d, dtype=torch.float32).reshape(10, d)
    b = 100 + a
    outs = ops.shard_and_stack([on(a, 0), on(b, 0)], [CPU(0), CPU(1)])
    assert [o.dist_device for o in outs] == [CPU(0), CPU(1)]
    assert [o.shape for o in outs] == [(2, 5, d), (2, 5, d)]
    assert torch.equal(outs[0].to_torch(), torch.stack([a[0:5], b[0:5]]))
    assert torch.equal(outs[1].to_torch(), torch.stack([a[5:10], b[5:10]]))


@pytest.mark.parametrize("axis", [1, -1])
def test_shard_and_stack_reference_axis1(axis: int) -> None:
    d = 4
    a = torch.arange(d * 10, dtype=torch.float32).reshape(d, 10)
    b = -a
    outs = ops.shard_and_stack([on(a, 0), on(b, 0)], [CPU(0), CPU(1)], axis=axis)
    assert [o.shape for o in outs] == [(2, d, 5), (2, d, 5)]
    assert torch.equal(outs[0].to_torch(), torch.stack([a[:, 0:5], b[:, 0:5]]))
    assert torch.equal(outs[1].to_torch(), torch.stack([a[:, 5:10], b[:, 5:10]]))


def test_shard_and_stack_one_input_one_device() -> None:
    a = torch.arange(6).reshape(2, 3)
    (out,) = ops.shard_and_stack([on(a, 0)], [CPU(5)])
    assert out.dist_device == CPU(5) and torch.equal(out.to_torch(), a[None])


# --- allreduce / reducescatter -------------------------------------------------------------
def test_allreduce_sum() -> None:
    outs = ops.allreduce.sum([on([1, 2], 0), on([10, 20], 1)], S2)
    assert [o.dist_device for o in outs] == [CPU(0), CPU(1)]
    assert values(outs) == [[11, 22], [11, 22]]


def test_allreduce_sum_is_bit_identical_to_device_order_sum() -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, generator=g) * 10.0 ** (3 * i) for i in range(4)]
    signals = Signals([CPU(i) for i in range(4)])
    outs = ops.allreduce.sum([on(x, i) for i, x in enumerate(xs)], signals)
    want = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    assert all(torch.equal(o.to_torch(), want) for o in outs)


def test_reducescatter_sum_uneven() -> None:
    outs = ops.reducescatter.sum([on([1, 2, 3], 0), on([10, 20, 30], 1)], S2)
    assert values(outs) == [[11, 22], [33]]


def test_reducescatter_sum_zero_size_shards_and_axis() -> None:
    signals = Signals([CPU(i) for i in range(3)])
    xs = [on(torch.full((2, 2), float(i)), i) for i in range(3)]
    outs = ops.reducescatter.sum(xs, signals, axis=-1)
    assert [o.shape for o in outs] == [(2, 1), (2, 1), (2, 0)]
    assert values(outs)[:2] == [[[3.0], [3.0]]] * 2


# --- new values, inputs untouched -----------------------------------------------------------
def test_outputs_are_new_values_and_inputs_are_untouched() -> None:
    x0, x1 = on([1.0, 2.0], 0), on([3.0, 4.0], 1)
    before = [x0.to_torch().clone(), x1.to_torch().clone()]
    results = [
        *ops.allgather([x0, x1], S2),
        *ops.allreduce.sum([x0, x1], S2),
        *ops.reducescatter.sum([x0, x1], S2),
        *ops.distributed_broadcast(x0, S2),
        ops.transfer_to(x0, CPU(0)),
        *ops.shard_and_stack([x0, x0], [CPU(0), CPU(1)]),
    ]
    inputs = {id(x0), id(x1)}
    locals_ = {id(x0.shards[0]), id(x1.shards[0])}
    for r in results:
        assert id(r) not in inputs
        assert id(r.shards[0]) not in locals_
    assert len({id(r.shards[0]) for r in results}) == len(results)
    assert torch.equal(x0.to_torch(), before[0]) and torch.equal(x1.to_torch(), before[1])


# --- gradients --------------------------------------------------------------------------------
def test_gradient_flows_through_allgather() -> None:
    x0 = on([1.0, 2.0], 0, requires_grad=True)
    x1 = on([3.0], 1, requires_grad=True)
    outs = ops.allgather([x0, x1], S2)
    weights = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])]
    loss = sum((o.to_torch() * w).sum() for o, w in zip(outs, weights, strict=True))
    loss.backward()  # type: ignore[union-attr]
    assert x0.grad is not None and x1.grad is not None
    assert x0.grad.to_torch().tolist() == [11.0, 22.0]
    assert x1.grad.to_torch().tolist() == [33.0]


def test_gradient_of_broadcast_sums_the_outputs_gradients() -> None:
    x = on([1.0, 2.0], 0, requires_grad=True)
    outs = ops.distributed_broadcast(x, Signals([CPU(0), CPU(1), CPU(2)]))
    sum(o.to_torch().sum() for o in outs).backward()  # type: ignore[union-attr]
    assert x.grad is not None and x.grad.to_torch().tolist() == [3.0, 3.0]


def test_gradient_of_reducescatter_is_a_gather() -> None:
    x0 = on([1.0, 2.0, 3.0], 0, requires_grad=True)
    x1 = on([4.0, 5.0, 6.0], 1, requires_grad=True)
    o0, o1 = ops.reducescatter.sum([x0, x1], S2)
    ((o0.to_torch() * 2).sum() + (o1.to_torch() * 5).sum()).backward()
    for x in (x0, x1):
        assert x.grad is not None and x.grad.to_torch().tolist() == [2.0, 2.0, 5.0]
