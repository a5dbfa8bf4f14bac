"""User errors of the communication ops: the right type, and a message naming the value."""

from __future__ import annotations

import re

import pytest
import torch

import shardwise as sw
from shardwise import (
    CPU,
    Accelerator,
    DeviceError,
    Partial,
    PlacementMapping,
    ReduceOp,
    Replicated,
    Sharded,
    ShardingError,
)
from shardwise.sharding.devices import accelerator_count
from shardwise.sharding.errors import ShardingTypeError
from tests.helpers.meshes import M4, M22


def x22(shape: tuple = (4, 4)) -> sw.Tensor:
    return sw.tensor(torch.ones(shape), sharding=PlacementMapping(M22, [Sharded(0), Replicated()]))


def raises(exc: type[BaseException], *needles: str):
    """pytest.raises whose message must contain every needle (literally)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(n)})" for n in needles))


# --- meshes ----------------------------------------------------------------------------
def test_plan_across_meshes() -> None:
    with raises(ShardingError, "DeviceMesh(dp=2, tp=2)", "DeviceMesh(x=4)", "to_device"):
        sw.plan(x22(), PlacementMapping(M4, [Sharded(0)]))


def test_shard_mesh_and_sharding_on_different_meshes() -> None:
    with raises(ShardingError, "DeviceMesh(x=4)", "DeviceMesh(dp=2, tp=2)"):
        sw.shard(x22(), M4, PlacementMapping(M22, [Sharded(0), Replicated()]))


def test_relayout_on_another_mesh_is_refused() -> None:
    target = sw.sharding.Layout.replicated(M4, 2)
    with raises(ShardingError, "DeviceMesh(x=4)"):
        x22().relayout(target)


def test_no_mesh_given_or_current() -> None:
    with raises(ShardingError, "mesh", "with mesh"):
        sw.distributed_broadcast(torch.ones(2))
    with raises(ShardingError, "mesh"):
        sw.shard(torch.ones(2), None, [None])
    with raises(ShardingTypeError, "'dp'"):
        sw.distributed_broadcast(torch.ones(2), "dp")


# --- axis names -----------------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda x: sw.shard(x, M22, ["zz", None]),
    lambda x: sw.all_reduce(x, reduce_axes="zz"),
    lambda x: sw.reduce_scatter(x, 0, reduce_axes=("dp", "zz")),
    lambda x: sw.ppermute(x, [(0, 1), (1, 0)], axis_name="zz"),
    lambda x: sw.all_to_all(x, 1, 0, axis_name="zz"),
], ids=["shard", "all_reduce", "reduce_scatter", "ppermute", "all_to_all"])
def test_unknown_axis_name(call) -> None:
    with raises(ShardingError, "'zz'", "['dp', 'tp']"):
        call(x22())


def test_axis_named_twice_and_bad_tensor_dims() -> None:
    with raises(ShardingError, "['dp', 'dp']"):
        sw.all_reduce(x22(), reduce_axes=("dp", "dp"))
    with raises(ShardingError, "5", "rank 2"):
        sw.all_gather(x22(), 5)
    with raises(ShardingError, "-3"):
        sw.reduce_scatter(x22(), -3)
    with raises(ShardingError, "dim 1", "not sharded"):
        sw.all_to_all(x22(), 0, 1)
    with raises(ShardingError, "'tp'", "'dp'"):
        sw.all_to_all(sw.tensor(torch.ones(4, 4), sharding=sw.NamedMapping(M22, (("dp", "tp"),))),
                      1, 0, axis_name="dp")
    with raises(ShardingError, "tiled=False"):
        sw.all_to_all(x22(), 1, 0, tiled=False)


def test_unknown_reduce_op_and_int_average() -> None:
    with raises(ShardingError, "'median'", "'sum'"):
        sw.all_reduce(x22(), reduce_op="median")
    ints = sw.tensor(torch.arange(4), sharding=PlacementMapping(M4, [Partial()]))
    with raises(ShardingError, "AVG", "torch.int64"):
        sw.all_reduce(ints, reduce_op="avg")


def test_unexpected_keyword_arguments() -> None:
    for call in (lambda: sw.all_reduce(x22(), axis=0), lambda: sw.all_gather(x22(), foo=1),
                 lambda: sw.reduce_scatter(x22(), 0, bar=2), lambda: sw.shard(x22(), M22,
                                                                             [None, None], baz=3)):
        with pytest.raises(TypeError):
            call()


# --- permutations ---------------------------------------------------------------------
@pytest.mark.parametrize(("perm", "needles"), [
    ([(0, 1), (0, 2)], ["device 0 twice", "source"]),
    ([(0, 1), (2, 1)], ["device 1 twice", "destination"]),
    ([(0, 7)], ["(0, 7)", "7", "[0, 4)"]),
    ([(-1, 0)], ["(-1, 0)", "-1"]),
    ([(0, 1, 2)], ["(0, 1, 2)", "pairs"]),
    ([(0, 1.5)], ["(0, 1.5)"]),
    ([0, 1], ["[0, 1]", "pairs"]),
    (5, ["5", "pairs"]),
], ids=["dup-src", "dup-dst", "range", "negative", "triple", "float", "flat", "int"])
def test_invalid_permutation(perm, needles: list[str]) -> None:
    x = sw.tensor(torch.ones(4, 2), sharding=PlacementMapping(M4, [Sharded(0)]))
    with raises(ShardingError, *needles):
        sw.ppermute(x, perm)


def test_permutation_out_of_range_along_axis() -> None:
    with raises(ShardingError, "(0, 2)", "'dp'", "[0, 2)"):
        sw.ppermute(x22(), [(0, 2)], axis_name="dp")


def test_permutation_breaking_replicas() -> None:
    r = sw.tensor(torch.ones(4, 4), sharding=PlacementMapping(M22, [Replicated(), Replicated()]))
    with raises(ShardingError, "[(0, 1)]", "['dp']", "Replicated"):
        sw.ppermute(r, [(0, 1)], axis_name="dp")


def test_permutation_between_unequal_uneven_blocks() -> None:
    x = sw.tensor(torch.ones(5, 2), sharding=PlacementMapping(M4, [Sharded(0)]))
    with raises(ShardingError, "(2, 2)", "(1, 2)", "device 0"):
        sw.ppermute(x, [(0, 1), (1, 0)])


# --- devices ----------------------------------------------------------------------------
def test_device_and_sharding_both_given() -> None:
    spec = PlacementMapping(M22, [Replicated(), Replicated()])
    for call in (lambda: sw.tensor([1.0], device=CPU(0), sharding=spec),
                 lambda: sw.to_device(x22(), CPU(0), sharding=spec),
                 lambda: sw.transfer_to(x22(), CPU(0), sharding=spec),
                 lambda: sw.zeros((2,), device=CPU(0), sharding=spec)):
        with raises(ShardingError, "CPU(0)", "PlacementMapping(DeviceMesh(dp=2, tp=2)"):
            call()


def test_accelerator_requested_with_none() -> None:
    """On this machine there is no accelerator: gpu()/accelerator() name what exists.
    (Where accelerators exist, the one past the last still raises.)"""
    n = accelerator_count()
    calls = [
        lambda: sw.accelerator(x22(), n),
        lambda: sw.to_device(x22(), Accelerator(n)),
        lambda: sw.tensor([1.0], device=Accelerator(n)),
        lambda: sw.zeros((2,), device=Accelerator(n + 3)),
    ]
    if n == 0:
        calls += [lambda: sw.gpu(x22()), lambda: sw.accelerator(x22())]
    else:
        y = sw.gpu(x22())
        assert y.dist_device == Accelerator(0) and torch.equal(y.to_torch().cpu(), torch.ones(4, 4))
    for call in calls:
        with raises(DeviceError, "Accelerator(", "does not exist", "Available devices: [CPU(0)"):
            call()


def test_not_a_device() -> None:
    with raises(DeviceError, "'cuda'", "str"):
        sw.to_device(x22(), "cuda")
    with raises(DeviceError, "'cpu'"):
        sw.tensor([1.0], device="cpu")


def test_device_of_a_multi_device_tensor() -> None:
    with raises(ShardingError, "4 devices", ".dist_device"):
        _ = x22().dist_device


# --- non-Tensor inputs ---------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda v: sw.all_gather(v),
    lambda v: sw.all_reduce(v),
    lambda v: sw.all_to_all(v, 0, 1),
    lambda v: sw.reduce_scatter(v, 0),
    lambda v: sw.ppermute(v, [(0, 1)]),
    lambda v: sw.plan(v, PlacementMapping(M4, [Replicated()])),
], ids=["all_gather", "all_reduce", "all_to_all", "reduce_scatter", "ppermute", "plan"])
@pytest.mark.parametrize("value", [torch.ones(4), [1.0, 2.0]], ids=["torch", "list"])
def test_non_tensor_input(call, value) -> None:
    name = type(value).__name__
    with pytest.raises(ShardingTypeError, match=f"got {name}") as info:
        call(value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_non_tensor_input_to_autodiff() -> None:
    with pytest.raises(TypeError, match="got Tensor"):
        sw.grad(lambda a: a)(torch.ones(3))
    with pytest.raises(TypeError, match="jvp primal 0"):
        sw.jvp(lambda a: a, (torch.ones(3),), (torch.ones(3),))
    with pytest.raises(TypeError, match="got float"):
        sw.grad(lambda a: 1.0)(x22())


# --- reductions over uneven splits ----------------------------------------------------
def test_all_reduce_over_unevenly_sharded_axis() -> None:
    x = x22((5, 4))
    with raises(ShardingError, "'dp'", "size 5", "unevenly", "2 pieces"):
        sw.all_reduce(x, reduce_axes="dp")
    with raises(ShardingError, "'dp'", "size 5"):
        sw.reduce_scatter(x, 1, reduce_axes="dp")
    with raises(ShardingError, "'dp'", "size 5"):
        sw.all_reduce(x)  # default: every mesh axis
    # the replicated axis alone is fine
    y = sw.all_reduce(x, reduce_axes="tp")
    assert torch.equal(y.to_torch(), torch.full((5, 4), 2.0))


def test_from_local_wrong_count_and_shape() -> None:
    spec = PlacementMapping(M4, [Sharded(0)])
    with raises(ShardingError, "3 local values", "4 devices"):
        sw.from_local([torch.ones(2)] * 3, spec)
    with raises(ShardingError, "CPU(3)", "(2,)", "(1,)"):
        sw.from_local([torch.ones(2)] * 4, spec, shape=(7,))


def test_backward_needs_grad_and_scalar() -> None:
    with raises(ShardingError, "does not require grad"):
        sw.tensor(1.0).backward()
    x = sw.tensor(torch.ones(3), requires_grad=True)
    with raises(ShardingError, "scalar", "(3,)"):
        sw.distributed_broadcast(x, M4).backward()
    with raises(ShardingError, "scalar"):
        sw.grad(lambda a: a)(x)
    with raises(ShardingError, "2 primals", "1 tangents"):
        sw.jvp(lambda a, b: a, (x, x), (x,))
    with raises(ShardingError, "global shape (3,)"):
        sw.jvp(lambda a: a, (x,), (torch.ones(4),))


def test_reduce_op_is_kept_by_error_free_paths() -> None:
    """A Partial's reduce op survives a reshard to another Partial layout (no silent
    loss of the op): MAX stays MAX."""
    x = sw.tensor(torch.ones(4), sharding=PlacementMapping(M22, [Partial(ReduceOp.MAX),
                                                                  Replicated()]))
    y = sw.shard(x, M22, PlacementMapping(M22, [Replicated(), Partial(ReduceOp.MAX)]))
    assert y.placements == (Replicated(), Partial(ReduceOp.MAX))
