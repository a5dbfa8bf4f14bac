"""Properties of the graph ops over random device counts, shapes and axes
(hypothesis): agreement with the torch expressions, the split rule, and
agreement of abstract evaluation with real runs."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise
from shardwise.graph import Signals, ops
from shardwise.sharding import TensorType
from shardwise.sharding.devices import CPU
from shardwise.sharding.shapes import split_size
from shardwise.tensors.tensor import Tensor

FAST = settings(max_examples=60, deadline=None)
DTYPES = [torch.float32, torch.float64, torch.int64]


def rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def types_of(outs: list[Tensor]) -> list[TensorType]:
    return [TensorType(o.dtype, o.shape, o.dist_device) for o in outs]


def abstract(xs: list[Tensor]) -> list[TensorType]:
    return [TensorType(x.dtype, x.shape, x.dist_device) for x in xs]


@st.composite
def gather_case(draw: Any) -> tuple[list[torch.Tensor], list[CPU], int]:
    n = draw(st.integers(2, 4))
    rank = draw(st.integers(1, 3))
    axis = draw(st.integers(-rank, rank - 1))
    base = draw(st.lists(st.integers(0, 3), min_size=rank, max_size=rank))
    sizes = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    ids = draw(st.permutations(range(6)))[:n]
    shapes = []
    for s in sizes:
        shape = list(base)
        shape[axis] = s
        shapes.append(tuple(shape))
    return ([rand(sh, dtype, seed + i) for i, sh in enumerate(shapes)],
            [CPU(i) for i in ids], axis)


@FAST
@given(gather_case())
def test_allgather_equals_torch_cat(case: tuple[list[torch.Tensor], list[CPU], int]) -> None:
    data, devices, axis = case
    xs = [shardwise.tensor(d, device=dev) for d, dev in zip(data, devices, strict=True)]
    signals = Signals(devices)
    outs = ops.allgather(xs, signals, axis=axis)
    want = torch.cat(data, dim=axis)
    assert [o.dist_device for o in outs] == devices
    assert all(torch.equal(o.to_torch(), want) for o in outs)
    assert ops.allgather(abstract(xs), signals, axis=axis) == types_of(outs)


@st.composite
def reduce_case(draw: Any) -> tuple[list[torch.Tensor], list[CPU], int]:
    n = draw(st.integers(2, 5))
    rank = draw(st.integers(1, 3))
    axis = draw(st.integers(-rank, rank - 1))
    shape = draw(st.lists(st.integers(0, 7), min_size=rank, max_size=rank))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    ids = draw(st.permutations(range(6)))[:n]
    return ([rand(tuple(shape), dtype, seed + i) for i in range(n)], [CPU(i) for i in ids], axis)


@FAST
@given(reduce_case())
def test_allreduce_equals_sum_in_device_order(case: tuple[list[torch.Tensor], list[CPU],
                                                          int]) -> None:
    data, devices, _ = case
    xs = [shardwise.tensor(d, device=dev) for d, dev in zip(data, devices, strict=True)]
    outs = ops.allreduce.sum(xs, Signals(devices))
    want = data[0]
    for d in data[1:]:
        want = want + d
    assert [o.dist_device for o in outs] == devices
    assert all(torch.equal(o.to_torch(), want) for o in outs)
    assert ops.allreduce.sum(abstract(xs), Signals(devices)) == types_of(outs)


@FAST
@given(reduce_case())
def test_reducescatter_pieces_follow_the_split_rule_and_concat_to_allreduce(
        case: tuple[list[torch.Tensor], list[CPU], int]) -> None:
    data, devices, axis = case
    xs = [shardwise.tensor(d, device=dev) for d, dev in zip(data, devices, strict=True)]
    signals = Signals(devices)
    pieces = ops.reducescatter.sum(xs, signals, axis=axis)
    total = ops.allreduce.sum(xs, signals)[0].to_torch()
    n, g = len(devices), data[0].shape[axis]
    assert [p.dist_device for p in pieces] == devices
    assert [p.shape[axis] for p in pieces] == [split_size(g, n, k) for k in range(n)]
    assert torch.equal(torch.cat([p.to_torch() for p in pieces], dim=axis), total)
    assert ops.reducescatter.sum(abstract(xs), signals, axis=axis) == types_of(pieces)


@FAST
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(0, 3),
       st.integers(1, 3), st.data())
def test_shard_and_stack_equals_stack_of_chunks(n_dev: int, n_in: int, rank: int,
                                                chunk: int, other: int, data: Any) -> None:
    axis = data.draw(st.integers(-rank, rank - 1))
    shape = [other] * rank
    shape[axis] = chunk * n_dev
    inputs = [rand(tuple(shape), torch.float32, i) for i in range(n_in)]
    xs = [shardwise.tensor(x, device=CPU(0)) for x in inputs]
    devices = [CPU(i) for i in range(n_dev)]
    outs = ops.shard_and_stack(xs, devices, axis=axis)
    for i, out in enumerate(outs):
        want = torch.stack([x.narrow(axis, i * chunk, chunk) for x in inputs])
        assert out.dist_device == devices[i]
        assert torch.equal(out.to_torch(), want)
    assert ops.shard_and_stack(abstract(xs), devices, axis=axis) == types_of(outs)


@FAST
@given(st.integers(2, 5), st.integers(0, 4), st.data())
def test_broadcast_and_transfer_keep_the_value(n: int, size: int, data: Any) -> None:
    root = data.draw(st.integers(0, n - 1))
    value = rand((size, 2), torch.float64, n)
    x = shardwise.tensor(value, device=CPU(root))
    signals = Signals([CPU(i) for i in range(n)])
    outs = ops.distributed_broadcast(x, signals)
    assert all(torch.equal(o.to_torch(), value) for o in outs)
    assert ops.distributed_broadcast(abstract([x])[0], signals) == types_of(outs)
    moved = ops.transfer_to(x, CPU(n))
    assert torch.equal(moved.to_torch(), value) and moved.dist_device == CPU(n)
