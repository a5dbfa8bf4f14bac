"""Every validation path of the graph ops, on Tensors and on TensorTypes: the
exception type and a message that names the bad value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise
from shardwise.graph import AxisError, Signals, ops
from shardwise.sharding import DeviceMesh, PlacementMapping, Sharded, ShardingError, TensorType
from shardwise.sharding.devices import CPU, DeviceError
from shardwise.sharding.errors import ShardingTypeError

KINDS = ["tensor", "type"]
S2 = Signals([CPU(0), CPU(1)])


def val(kind: str, shape: tuple[int, ...], i: int, dtype: torch.dtype = torch.float32) -> Any:
    if kind == "tensor":
        return shardwise.tensor(torch.zeros(shape, dtype=dtype), device=CPU(i))
    return TensorType(dtype, shape, CPU(i))


def two(kind: str, s0: tuple[int, ...] = (2, 3), s1: tuple[int, ...] = (2, 3),
        d1: torch.dtype = torch.float32) -> list[Any]:
    return [val(kind, s0, 0), val(kind, s1, 1, d1)]


Case = tuple[Callable[[str], Any], type[Exception], str]

COLLECTIVES: dict[str, Callable[..., Any]] = {
    "allgather": ops.allgather,
    "allreduce.sum": ops.allreduce.sum,
    "reducescatter.sum": ops.reducescatter.sum,
}

COLLECTIVE_CASES: dict[str, tuple[Callable[[str, Callable[..., Any]], Any], type[Exception],
                                  str]] = {
    "count": (lambda k, op: op([*two(k), val(k, (2, 3), 2)], S2), ShardingError,
              r"got 3 inputs for 2 signal buffers \(devices \[CPU\(0\), CPU\(1\)\]\)"),
    "no participant": (lambda k, op: op([], []), ShardingError,
                       r"at least 1 participating device, got none"),
    "repeated devices": (lambda k, op: op(two(k), [S2.buffers()[0]] * 2), ShardingError,
                         r"CPU\(0\) 2 times"),
    "wrong device": (lambda k, op: op([val(k, (2, 3), 0), val(k, (2, 3), 2)], S2),
                     ShardingError, r"inputs\[1\] is on CPU\(2\) but signal buffer 1 is on "
                                    r"CPU\(1\).*transfer_to"),
    "order": (lambda k, op: op(two(k)[::-1], S2), ShardingError,
              r"inputs\[0\] is on CPU\(1\) but signal buffer 0 is on CPU\(0\)"),
    "rank": (lambda k, op: op(two(k, s1=(2, 3, 1)), S2), ShardingError,
             r"inputs\[1\] has rank 3 \(shape \(2, 3, 1\)\) but inputs\[0\] has rank 2"),
    "dtype": (lambda k, op: op(two(k, d1=torch.float64), S2), ShardingError,
              r"inputs\[1\] has dtype float64 but inputs\[0\] has float32"),
    "non-axis dim": (lambda k, op: op(two(k, s1=(2, 4)), S2), ShardingError,
                     r"inputs\[1\] has shape \(2, 4\) but inputs\[0\] has shape \(2, 3\): "
                     r"dim 1 differs \(4 vs 3\)"),
    "torch tensor": (lambda k, op: op([torch.zeros(2, 3), val(k, (2, 3), 1)], S2),
                     ShardingTypeError, r"inputs\[0\] must be .*torch.Tensor cannot say"),
    "mixed kinds": (lambda k, op: op([val("tensor", (2, 3), 0), val("type", (2, 3), 1)], S2),
                    ShardingTypeError, r"mixes Tensors and TensorTypes"),
    "not a list": (lambda k, op: op(val(k, (2, 3), 0), S2), ShardingTypeError,
                   r"got a single (Tensor|TensorType)\. Wrap it in a list"),
    "not iterable": (lambda k, op: op(3, S2), ShardingTypeError, r"got int"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op_name", list(COLLECTIVES))
@pytest.mark.parametrize("case", list(COLLECTIVE_CASES))
def test_collective_errors(case: str, op_name: str, kind: str) -> None:
    call, exc, pattern = COLLECTIVE_CASES[case]
    op = COLLECTIVES[op_name]
    with pytest.raises(exc, match=pattern) as err:
        call(kind, op)
    assert isinstance(err.value, ValueError)
    assert op_name in str(err.value)


@pytest.mark.parametrize("kind", KINDS)
def test_allgather_sizes_may_differ_only_along_the_axis(kind: str) -> None:
    with pytest.raises(ShardingError, match=r"dim 0 differs \(3 vs 2\).*only along the "
                                            r"gather axis 1"):
        ops.allgather(two(kind, s1=(3, 3)), S2, axis=1)
    with pytest.raises(ShardingError, match=r"dim 1 differs.*must be equal"):
        ops.allreduce.sum(two(kind, s1=(2, 4)), S2)
    with pytest.raises(ShardingError, match=r"dim 0 differs.*must be equal"):
        ops.reducescatter.sum(two(kind, s1=(3, 3)), S2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("axis", [2, -3, 7])
@pytest.mark.parametrize("op_name", ["allgather", "reducescatter.sum"])
def test_axis_out_of_range_is_an_index_error(kind: str, axis: int, op_name: str) -> None:
    op = COLLECTIVES[op_name]
    with pytest.raises(IndexError, match=rf"{op_name} axis {axis} is out of range for values "
                                         r"of rank 2: use -2 <= axis < 2") as err:
        op(two(kind), S2, axis=axis)
    assert isinstance(err.value, AxisError) and isinstance(err.value, ShardingError)


@pytest.mark.parametrize("kind", KINDS)
def test_rank0_has_no_axis(kind: str) -> None:
    with pytest.raises(AxisError, match="rank-0 values have no axis"):
        ops.allgather(two(kind, (), ()), S2)
    with pytest.raises(AxisError, match="rank-0 values have no axis"):
        ops.reducescatter.sum(two(kind, (), ()), S2)
    assert [o.shape for o in ops.allreduce.sum(two(kind, (), ()), S2)] == [(), ()]


@pytest.mark.parametrize("axis", [1.0, "0", True, None])
def test_axis_must_be_an_int(axis: object) -> None:
    with pytest.raises(ShardingTypeError, match=rf"allgather axis must be an int. Got {axis!r}"):
        ops.allgather(two("tensor"), S2, axis=axis)  # type: ignore[arg-type]


def test_multi_device_tensor_is_refused() -> None:
    mesh = DeviceMesh.cpu(2, "x")
    t = shardwise.tensor(torch.zeros(4), sharding=PlacementMapping(mesh, [Sharded(0)]))
    with pytest.raises(ShardingTypeError, match=r"inputs\[0\] is Tensor.*2 devices.*from_tensor"):
        ops.allgather([t, t], S2)
    with pytest.raises(ShardingTypeError, match=r"transfer_to x is Tensor.*2 devices"):
        ops.transfer_to(t, CPU(0))


def test_distributed_type_is_refused_with_a_hint() -> None:
    mesh = DeviceMesh.cpu(2, "x")
    t = shardwise.tensor(torch.zeros(4), sharding=PlacementMapping(mesh, [Sharded(0)]))
    with pytest.raises(ShardingTypeError, match=r"got DistributedTensorType.*local_types"):
        ops.transfer_to(t.dist_type, CPU(0))


def test_other_values_are_refused() -> None:
    with pytest.raises(ShardingTypeError, match=r"got list: pass a single-device"):
        ops.transfer_to([1.0], CPU(0))


def test_type_device_must_be_a_shardwise_device() -> None:
    bad = TensorType(torch.float32, (2,), "cpu")
    with pytest.raises(DeviceError, match=r"inputs\[1\] is .*device 'cpu' is not a shardwise"):
        ops.allgather([TensorType(torch.float32, (2,), CPU(0)), bad], S2)


# --- distributed_broadcast ----------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_broadcast_root_must_participate(kind: str) -> None:
    with pytest.raises(ShardingError, match=r"input is on CPU\(3\), which is not among the "
                                            r"signal buffers' devices \[CPU\(0\), CPU\(1\)\]"):
        ops.distributed_broadcast(val(kind, (2,), 3), S2)


@pytest.mark.parametrize("kind", KINDS)
def test_broadcast_needs_distinct_buffers(kind: str) -> None:
    x = val(kind, (2,), 0)
    with pytest.raises(ShardingError, match=r"distributed_broadcast signal_buffers needs at "
                                            r"least 1 participating device, got none"):
        ops.distributed_broadcast(x, [])
    assert len(ops.distributed_broadcast(x, S2.buffers()[:1])) == 1  # one device: a no-op
    with pytest.raises(ShardingError, match=r"CPU\(0\) 2 times"):
        ops.distributed_broadcast(x, [S2.buffers()[0]] * 2)


# --- transfer_to ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), 1, None])
def test_transfer_to_needs_a_device(kind: str, device: object) -> None:
    with pytest.raises(DeviceError, match=rf"transfer_to needs a shardwise device.*Got "
                                          rf"{str(device)!r}" if isinstance(device, str)
                       else r"transfer_to needs a shardwise device"):
        ops.transfer_to(val(kind, (2,), 0), device)  # type: ignore[arg-type]


# --- shard_and_stack -------------------------------------------------------------------------
def _host(kind: str, shape: tuple[int, ...] = (10, 3), dtype: torch.dtype = torch.float32,
          i: int = 0) -> Any:
    return val(kind, shape, i, dtype)


SAS_CASES: dict[str, tuple[Callable[[str], Any], type[Exception], str]] = {
    "no inputs": (lambda k: ops.shard_and_stack([], [CPU(0)]), ShardingError,
                  r"at least one input; got inputs=\[\]"),
    "no devices": (lambda k: ops.shard_and_stack([_host(k)], []), ShardingError,
                   r"at least one target device; got devices=\[\]"),
    "shape": (lambda k: ops.shard_and_stack([_host(k), _host(k, (10, 4))], [CPU(0)]),
              ShardingError, r"inputs\[1\] has shape \(10, 4\) but inputs\[0\] has \(10, 3\)"),
    "dtype": (lambda k: ops.shard_and_stack([_host(k), _host(k, dtype=torch.int32)], [CPU(0)]),
              ShardingError, r"inputs\[1\] has dtype 'int32' but inputs\[0\] has 'float32'"),
    "device": (lambda k: ops.shard_and_stack([_host(k), _host(k, i=1)], [CPU(0)]),
               ShardingError, r"inputs\[1\] has device CPU\(1\) but inputs\[0\] has CPU\(0\)"),
    "repeated devices": (lambda k: ops.shard_and_stack([_host(k)], [CPU(0), CPU(0)]),
                         ShardingError, r"lists CPU\(0\) 2 times"),
    "not a device": (lambda k: ops.shard_and_stack([_host(k)], [CPU(0), "cpu"]), DeviceError,
                     r"devices\[1\] is 'cpu' \(str\), not a shardwise device"),
    "devices not iterable": (lambda k: ops.shard_and_stack([_host(k)], 2), ShardingTypeError,
                             r"devices must be a list of devices, got 2"),
    "single device": (lambda k: ops.shard_and_stack([_host(k)], CPU(0)), ShardingTypeError,
                      r"devices must be a list of devices, got CPU\(0\)"),
    "axis": (lambda k: ops.shard_and_stack([_host(k)], [CPU(0)], axis=2), AxisError,
             r"shard_and_stack axis 2 is out of range for values of rank 2"),
    "negative axis": (lambda k: ops.shard_and_stack([_host(k)], [CPU(0)], axis=-3), IndexError,
                      r"axis -3 is out of range"),
    "divisible": (lambda k: ops.shard_and_stack([_host(k), _host(k)], [CPU(0), CPU(1), CPU(2)]),
                  ShardingError, r"Cannot shard inputs with shape \(10, 3\) across 3 devices: "
                                 r"axis 0 \(size 10\) must be divisible by 3\."),
    "divisible axis 1": (lambda k: ops.shard_and_stack([_host(k)], [CPU(0), CPU(1)], axis=-1),
                         ShardingError, r"across 2 devices: axis 1 \(size 3\) must be "
                                        r"divisible by 2"),
    "torch input": (lambda k: ops.shard_and_stack([torch.zeros(10, 3)], [CPU(0)]),
                    ShardingTypeError, r"inputs\[0\] must be a single-device"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(SAS_CASES))
def test_shard_and_stack_errors(case: str, kind: str) -> None:
    call, exc, pattern = SAS_CASES[case]
    with pytest.raises(exc, match=pattern) as err:
        call(kind)
    assert isinstance(err.value, ValueError)  # the reference raises ValueError for all of these
