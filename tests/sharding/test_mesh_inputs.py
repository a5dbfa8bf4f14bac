"""Bad inputs to the mesh and mapping constructors: ShardingTypeError for a wrong
type, ShardingError for a wrong value, each naming the argument and the value."""

from __future__ import annotations

import re
from typing import Any

import pytest

from shardwise.sharding import (
    DeviceMesh,
    NamedMapping,
    PlacementMapping,
    Replicated,
    ShardingError,
    ShardingSpec,
)
from shardwise.sharding.devices import CPU
from shardwise.sharding.errors import ShardingTypeError
from tests.helpers.meshes import M22 as MESH


def raises(exc: type[BaseException], *needles: str) -> Any:
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(n)})" for n in needles))


@pytest.mark.parametrize(("shape", "needles"), [
    ((2, 0), ["mesh_shape=(2, 0)", "Got 0 at axis 1", ">= 1"]),
    ((-1,), ["mesh_shape=(-1,)", "Got -1 at axis 0"]),
    (0, ["mesh_shape=(0,)", "Got 0"]),
])
def test_cpu_sizes_below_one_name_the_shape(shape: Any, needles: list[str]) -> None:
    with raises(ShardingError, "DeviceMesh.cpu", *needles) as err:
        DeviceMesh.cpu(shape, ("a", "b")[: len(shape) if isinstance(shape, tuple) else 1])
    assert not isinstance(err.value, TypeError)  # a wrong value, not a wrong type


@pytest.mark.parametrize(("call", "needles"), [
    (lambda: DeviceMesh.cpu(None, "a"), ["mesh_shape", "int or a sequence of ints", "None"]),
    (lambda: DeviceMesh.cpu(2.0, "a"), ["mesh_shape", "2.0 (float)"]),
    (lambda: DeviceMesh.cpu((2, "a"), ("a", "b")), ["mesh_shape=(2, 'a')", "'a' (str)"]),
    (lambda: DeviceMesh.cpu(True, "a"), ["mesh_shape=(True,)", "True (bool)"]),
    (lambda: DeviceMesh.cpu(2, None), ["axis_names", "str or a sequence of str", "None"]),
    (lambda: DeviceMesh.cpu(2, 5), ["axis_names", "5 (int)"]),
    (lambda: DeviceMesh(None, (1,), ("a",)), ["DeviceMesh devices", "sequence of devices"]),
    (lambda: DeviceMesh(5, (1,), ("a",)), ["DeviceMesh devices", "5 (int)"]),
    (lambda: DeviceMesh((CPU(0),), None, ("a",)), ["DeviceMesh mesh_shape", "None"]),
    (lambda: PlacementMapping(MESH, 5), ["PlacementMapping placements", "5 (int)"]),
    (lambda: PlacementMapping(MESH, [5, Replicated()]), ["placements", "5 (int)"]),
    (lambda: PlacementMapping(5, [Replicated()]), ["needs a DeviceMesh", "5 (int)"]),
    (lambda: NamedMapping(MESH, 5), ["NamedMapping spec", "one entry per tensor dim", "5"]),
    (lambda: NamedMapping(MESH, ("dp",), unreduced=3), ["unreduced", "3 (int)"]),
    (lambda: ShardingSpec(MESH, 5), ["ShardingSpec dim_specs", "5 (int)"]),
    (lambda: ShardingSpec(MESH, ["dp"], replicated_axes=5), ["replicated_axes", "5 (int)"]),
    (lambda: ShardingSpec(MESH, ["dp"], replicated_axes=[1]), ["replicated_axes", "1"]),
])
def test_wrong_types_name_the_argument_and_the_expected_type(call: Any,
                                                             needles: list[str]) -> None:
    with raises(ShardingTypeError, *needles) as err:
        call()
    assert isinstance(err.value, TypeError) and isinstance(err.value, ShardingError)


def test_good_inputs_still_work() -> None:
    assert DeviceMesh.cpu(3, "x").mesh_shape == (3,)
    assert DeviceMesh.cpu([2, 1], ["a", "b"]).axis_names == ("a", "b")
    assert ShardingSpec(MESH, ["dp", None], replicated_axes=["tp"]).replicated_axes == {"tp"}
