"""Bad inputs across the public API (constructors, creation, communication ops,
shard_map, lax, debug): a ShardingError-family error naming the argument, the
value and the rule; never a bare TypeError/AttributeError or a torch error."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import DeviceMesh, Partial, PlacementMapping, Replicated, Sharded, lax
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from tests.helpers.meshes import M2

X = torch.ones(4, 2)


def raises(exc: type[BaseException], *needles: str) -> Any:
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(n)})" for n in needles))


def partial(dtype: torch.dtype, op: str, mesh: DeviceMesh = M2) -> sw.Tensor:
    return sw.tensor(torch.ones(4, dtype=dtype), sharding=PlacementMapping(
        mesh, [Partial(op)] * mesh.ndim))


TYPE_CASES: dict[str, tuple[Any, list[str]]] = {
    "shard dim_specs": (lambda: sw.shard(X, M2, 5), ["dim_specs", "5 (int)"]),
    "shard replicated_axes": (lambda: sw.shard(X, M2, ["x"], replicated_axes=5),
                              ["replicated_axes", "5 (int)"]),
    "tensor sharding": (lambda: sw.tensor(X, sharding=5), ["sharding", "PlacementMapping",
                                                          "5 (int)"]),
    "zeros shape str": (lambda: sw.zeros("a", sharding=PlacementMapping(M2, [Sharded(0)])),
                        ["shape", "'a' (str)"]),
    "zeros shape float": (lambda: sw.zeros(2.5), ["shape", "2.5 (float)"]),
    "ones shape entry": (lambda: sw.ones((2, None)), ["shape (2, None)", "None"]),
    "from_local shards": (lambda: sw.from_local(5, PlacementMapping(M2, [Sharded(0)])),
                          ["from_local shards", "5 (int)"]),
    "from_local shape": (lambda: sw.from_local([X, X], PlacementMapping(M2, [Sharded(0)]),
                                               shape="ab"), ["from_local shape", "'ab'"]),
    "all_reduce reduce_axes": (lambda: sw.all_reduce(partial(torch.float32, "sum"),
                                                     reduce_axes=2.5), ["reduce_axes", "2.5"]),
    "all_gather axis": (lambda: sw.all_gather(sw.tensor(X, sharding=PlacementMapping(
        M2, [Sharded(0)])), axis="a"), ["all_gather axis must be an int", "'a' (str)"]),
    "all_to_all split_axis": (lambda: sw.all_to_all(sw.tensor(X, sharding=PlacementMapping(
        M2, [Sharded(0)])), None, 0), ["all_to_all split_axis", "None"]),
    "visualize": (lambda: sw.visualize(5), ["visualize needs a shardwise.Tensor", "int"]),
    "tensor dtype": (lambda: sw.tensor(X, dtype=5), ["dtype must be a torch.dtype", "5 (int)"]),
    "requires_grad int": (lambda: sw.tensor(torch.ones(2, dtype=torch.int64),
                                            requires_grad=True),
                          ["requires_grad=True", "floating", "torch.int64"]),
    "ppermute permutation": (lambda: sw.ppermute(sw.tensor(X, sharding=PlacementMapping(
        M2, [Sharded(0)])), 5), ["ppermute permutation", "pairs", "5"]),
    "ppermute pair": (lambda: sw.ppermute(sw.tensor(X, sharding=PlacementMapping(
        M2, [Sharded(0)])), [(0, "a")]), ["(src, dst) pairs of ints", "(0, 'a')"]),
    "lax axis_name": (lambda: sw.shard_map(lambda a: lax.psum(a, 5), M2, (None,), None)(X),
                      ["lax.psum: axis_name", "Got 5"]),
    "lax perm": (lambda: sw.shard_map(lambda a: lax.ppermute(a, "x", 5), M2, (None,),
                                      None)(X), ["lax.ppermute: perm", "Got 5"]),
    "shard_map timeout_s": (lambda: sw.shard_map(lambda a: a, M2, (None,), None,
                                                 timeout_s="a"), ["timeout_s", "'a' (str)"]),
    "shard_map in_specs": (lambda: sw.shard_map(lambda a: a, M2, 5, None)(X),
                           ["in_specs is 5 (int)", "one spec per argument"]),
    "shard_map spec": (lambda: sw.shard_map(lambda a: a, M2, (5,), None)(X),
                       ["in_specs[0] is 5 (int), not a spec"]),
    "eval_shape fn": (lambda: sw.eval_shape(5, X), ["eval_shape needs a function", "5"]),
    "grad fn": (lambda: sw.grad(5), ["value_and_grad needs a function", "5 (int)"]),
    "jvp primals": (lambda: sw.jvp(lambda a: a, 5, 5), ["jvp primals", "5 (int)"]),
    "mesh groups": (lambda: M2.groups(5), ["groups axes", "5 (int)"]),
    "mesh devices_along": (lambda: M2.devices_along("x", 0), ["devices_along coord", "0"]),
}


@pytest.mark.parametrize("name", list(TYPE_CASES))
def test_wrong_types_name_the_argument(name: str) -> None:
    call, needles = TYPE_CASES[name]
    with raises(ShardingTypeError, *needles):
        call()


def test_negative_sizes_are_value_errors() -> None:
    with raises(ShardingError, "shape (2, -1)", "Got -1 at dim 1") as err:
        sw.zeros((2, -1), sharding=PlacementMapping(M2, [Sharded(0)]))
    assert not isinstance(err.value, TypeError)


@pytest.mark.parametrize(("dtype", "op", "needles"), [
    (torch.complex64, "max", ["complex64", "ReduceOp.MAX", "no order"]),
    (torch.complex128, "min", ["complex128", "ReduceOp.MIN"]),
    (torch.int32, "avg", ["torch.int32", "ReduceOp.AVG", "integer dtype"]),
    (torch.bool, "avg", ["torch.bool", "ReduceOp.AVG"]),
])
@pytest.mark.parametrize("mesh", [M2, DeviceMesh.cpu(1, "x"), DeviceMesh.cpu((2, 2), ("a", "b"))])
def test_unsupported_dtype_for_a_reduce_op(dtype: torch.dtype, op: str, needles: list[str],
                                           mesh: DeviceMesh) -> None:
    """all_reduce / reduce_scatter / lax: a ShardingTypeError naming the dtype and the
    op, the same on every mesh size (one device included)."""
    p = partial(dtype, op, mesh)
    with raises(ShardingTypeError, *needles):
        sw.all_reduce(p)
    with raises(ShardingTypeError, *needles):
        sw.reduce_scatter(p, 0)
    if op in ("max", "min"):
        lax_op = {"max": lax.pmax, "min": lax.pmin}[op]
        names = mesh.axis_names
        with raises(ShardingTypeError, *needles):
            sw.shard_map(lambda a: lax_op(a, names), mesh, in_specs=(None,),
                         out_specs=None)(torch.ones(4, dtype=dtype))


@pytest.mark.parametrize(("dtype", "op"), [
    (torch.complex64, "sum"), (torch.complex64, "prod"), (torch.complex64, "avg"),
    (torch.bool, "max"), (torch.bool, "min"), (torch.int64, "max"), (torch.int64, "sum"),
    (torch.bool, "sum"),
])
def test_supported_dtype_op_pairs_still_reduce(dtype: torch.dtype, op: str) -> None:
    out = sw.all_reduce(partial(dtype, op)).to_torch()  # resolving a Partial keeps the value
    assert out.dtype == dtype
    assert torch.equal(out, torch.ones(4, dtype=dtype))


def test_collectives_over_one_device_are_no_ops() -> None:
    """Code stays generic across mesh sizes: every op works on a one-device mesh."""
    m1 = DeviceMesh.cpu(1, "x")
    x = torch.arange(6.0).reshape(3, 2)
    s = sw.tensor(x, sharding=PlacementMapping(m1, [Sharded(0)]))
    p = sw.tensor(x, sharding=PlacementMapping(m1, [Partial("max")]))
    assert torch.equal(sw.all_gather(s).to_torch(), x)
    assert torch.equal(sw.all_to_all(s, 1, 0).to_torch(), x)
    assert torch.equal(sw.all_reduce(p).to_torch(), x)
    assert torch.equal(sw.reduce_scatter(p, 0).to_torch(), x)
    assert torch.equal(sw.ppermute(s, [(0, 0)]).to_torch(), x)
    assert torch.equal(sw.distributed_broadcast(x, m1).to_torch(), x)
    f = sw.shard_map(lambda a: lax.psum_scatter(lax.all_gather(lax.pmax(a, "x"), "x",
                                                              tiled=True), "x"),
                     m1, in_specs=(("x",),), out_specs=("x",))
    assert torch.equal(f(x).to_torch(), x)
    r = sw.tensor(x, sharding=PlacementMapping(m1, [Replicated()]))
    assert torch.equal(sw.all_reduce(r).to_torch(), x)
