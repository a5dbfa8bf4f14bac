"""DeviceMesh: validation, reprs, axis and coordinate queries, the current-mesh context."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re
import threading

import pytest

from shardwise.sharding import DeviceMesh, ShardingError, current_mesh
from shardwise.sharding.devices import CPU, Accelerator, VirtualDevice


@pytest.fixture
def mesh() -> DeviceMesh:
    return DeviceMesh.cpu((2, 4), ("dp", "tp"))


# --- validation -------------------------------------------------------------------


def test_empty_devices_raise() -> None:
    with pytest.raises(ShardingError, match="at least one device"):
        DeviceMesh((), (1,), ("x",))


def test_prod_mismatch_names_both_counts() -> None:
    with pytest.raises(ShardingError, match=r"mesh_shape=\(2, 2\) holds 4 devices but 3"):
        DeviceMesh((CPU(0), CPU(1), CPU(2)), (2, 2), ("a", "b"))


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_bad_axis_size_raises_naming_it(bad: object) -> None:
    with pytest.raises(ShardingError, match=f"Got {bad!r}"):
        DeviceMesh((CPU(0), CPU(1)), (2, bad), ("a", "b"))


def test_names_count_mismatch() -> None:
    with pytest.raises(ShardingError, match=r"2 axes .* 1 names \('dp',\)"):
        DeviceMesh.cpu((2, 2), ("dp",))
    with pytest.raises(ShardingError, match="one name per axis"):
        DeviceMesh.cpu((4,), ("dp", "tp"))


def test_duplicate_names() -> None:
    with pytest.raises(ShardingError, match=r"unique.*\['x'\] repeated"):
        DeviceMesh.cpu((2, 2), ("x", "x"))


@pytest.mark.parametrize("bad", [1, None, "", ("x",)])
def test_non_str_or_empty_names(bad: object) -> None:
    with pytest.raises(ShardingError, match="non-empty strings") as info:
        DeviceMesh.cpu((2, 2), ("x", bad))
    assert repr(bad) in str(info.value)


def test_duplicate_devices_named() -> None:
    with pytest.raises(ShardingError, match=r"unique\. Got CPU\(1\) more than once"):
        DeviceMesh((CPU(0), CPU(1), CPU(1), CPU(3)), (2, 2), ("a", "b"))


def test_unhashable_device() -> None:
    with pytest.raises(ShardingError, match=r"hashable.*\[0\]"):
        DeviceMesh(([0], [1]), (2,), ("x",))


def test_errors_are_value_errors() -> None:
    assert issubclass(ShardingError, ValueError)
    with pytest.raises(ValueError):
        DeviceMesh.cpu((3,), ("x", "y"))


def test_int_shape_and_str_name_are_normalised() -> None:
    m = DeviceMesh((CPU(0), CPU(1), CPU(2)), 3, "x")
    assert m.mesh_shape == (3,)
    assert m.axis_names == ("x",)
    assert DeviceMesh.cpu(3, "x") == m


def test_lists_are_normalised_to_tuples() -> None:
    m = DeviceMesh([CPU(0), CPU(1)], [2], ["x"])
    assert m.devices == (CPU(0), CPU(1))
    assert m.mesh_shape == (2,)
    assert m.axis_names == ("x",)


def test_frozen(mesh: DeviceMesh) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        mesh.axis_names = ("a", "b")


# --- reprs and basic queries ---------------------------------------------------------


def test_repr(mesh: DeviceMesh) -> None:
    assert repr(mesh) == "DeviceMesh(dp=2, tp=4)"
    assert repr(DeviceMesh.cpu(4, "tp")) == "DeviceMesh(tp=4)"
    assert repr(DeviceMesh.cpu((1, 2, 3), ("a", "b", "c"))) == "DeviceMesh(a=1, b=2, c=3)"


def test_shape_queries(mesh: DeviceMesh) -> None:
    assert mesh.ndim == 2
    assert mesh.shape == mesh.mesh_shape == (2, 4)
    assert mesh.num_devices == 8
    assert not mesh.is_single
    assert mesh.is_simulated
    assert list(mesh) == [CPU(i) for i in range(8)]


def test_cpu_builds_virtual_devices(mesh: DeviceMesh) -> None:
    assert mesh.devices == tuple(CPU(i) for i in range(8))
    assert mesh.axis_names == ("dp", "tp")


def test_single() -> None:
    m = DeviceMesh.single(CPU(3))
    assert m.is_single
    assert m.devices == (CPU(3),)
    assert m.mesh_shape == (1,)
    assert m.num_devices == 1
    assert DeviceMesh.single(CPU(0), "x").axis_names == ("x",)


def test_is_simulated_false_with_accelerators() -> None:
    m = DeviceMesh((Accelerator(0), Accelerator(1)), (2,), ("x",))
    assert not m.is_simulated
    assert not DeviceMesh((CPU(0), Accelerator(0)), (2,), ("x",)).is_simulated


def test_is_simulated_with_virtual_devices_of_one_memory() -> None:
    one_gpu = DeviceMesh(tuple(VirtualDevice(i) for i in range(4)), (2, 2), ("dp", "tp"))
    assert one_gpu.is_simulated and repr(one_gpu) == "DeviceMesh(dp=2, tp=2)"
    two_gpus = DeviceMesh(tuple(VirtualDevice(i, on=Accelerator(i // 2)) for i in range(4)),
                          (4,), ("x",))
    assert not two_gpus.is_simulated   # blocks move between the two GPUs
    assert not DeviceMesh((VirtualDevice(0), Accelerator(1)), (2,), ("x",)).is_simulated
    assert not DeviceMesh(("a", "b"), (2,), ("x",)).is_simulated   # not device values


# --- axis_index / axis_size ----------------------------------------------------------


def test_axis_index_by_name_and_index(mesh: DeviceMesh) -> None:
    assert mesh.axis_index("dp") == 0
    assert mesh.axis_index("tp") == 1
    assert mesh.axis_index(0) == 0
    assert mesh.axis_index(1) == 1
    assert mesh.axis_index(-1) == 1
    assert mesh.axis_index(-2) == 0


def test_axis_size(mesh: DeviceMesh) -> None:
    assert mesh.axis_size("dp") == 2
    assert mesh.axis_size("tp") == 4
    assert mesh.axis_size(-1) == 4
    assert mesh.axis_size(0) == 2


def test_unknown_axis_name(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match=r"Unknown mesh axis 'pp'.*\['dp', 'tp'\]"):
        mesh.axis_size("pp")


@pytest.mark.parametrize("bad", [2, -3, 100])
def test_axis_index_out_of_range(mesh: DeviceMesh, bad: int) -> None:
    with pytest.raises(ShardingError, match=f"index {bad} is out of range"):
        mesh.axis_index(bad)


@pytest.mark.parametrize("bad", [True, False, 1.0, None, ("dp",)])
def test_axis_index_wrong_type(mesh: DeviceMesh, bad: object) -> None:
    with pytest.raises(ShardingError, match="str or an int") as info:
        mesh.axis_index(bad)
    assert f"Got {bad!r}" in str(info.value)


# --- coordinates ------------------------------------------------------------------


def test_coord_round_trip(mesh: DeviceMesh) -> None:
    for k, dev in enumerate(mesh.devices):
        coord = mesh.device_coord(dev)
        assert coord == mesh.coord_of(k)
        assert mesh.index_of(coord) == k
        assert mesh.device_index(dev) == k
    # row-major: the last axis varies fastest
    assert mesh.coord_of(0) == (0, 0)
    assert mesh.coord_of(1) == (0, 1)
    assert mesh.coord_of(4) == (1, 0)
    assert mesh.coord_of(7) == (1, 3)


def test_coord_round_trip_three_axes() -> None:
    m = DeviceMesh.cpu((2, 3, 2), ("a", "b", "c"))
    coords = [m.coord_of(k) for k in range(m.num_devices)]
    assert coords == sorted(coords)  # row-major order is lexicographic
    assert len(set(coords)) == 12
    assert all(m.index_of(c) == k for k, c in enumerate(coords))
    assert m.coord_of(7) == (1, 0, 1)


def test_device_not_in_mesh(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match=r"CPU\(8\) is not in DeviceMesh\(dp=2, tp=4\)"):
        mesh.device_coord(CPU(8))
    with pytest.raises(ShardingError, match=r"Accelerator\(0\) is not in"):
        mesh.device_index(Accelerator(0))


@pytest.mark.parametrize("bad", [-1, 8, 100])
def test_coord_of_out_of_range(mesh: DeviceMesh, bad: int) -> None:
    with pytest.raises(ShardingError, match=f"Device index {bad} is out of range"):
        mesh.coord_of(bad)


def test_coord_of_wrong_type(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match="Got True"):
        mesh.coord_of(True)
    with pytest.raises(ShardingError, match=r"Got 1\.0"):
        mesh.coord_of(1.0)


@pytest.mark.parametrize("bad", [(1,), (0, 0, 0), (2, 0), (0, 4), (0, -1)])
def test_index_of_bad_coord(mesh: DeviceMesh, bad: tuple[int, ...]) -> None:
    with pytest.raises(ShardingError, match=re.escape(f"Coordinate {bad!r}")):
        mesh.index_of(bad)


# --- devices_along / groups ------------------------------------------------------------


def test_devices_along(mesh: DeviceMesh) -> None:
    assert mesh.devices_along("tp", (1, 0)) == (CPU(4), CPU(5), CPU(6), CPU(7))
    assert mesh.devices_along("tp", (0, 2)) == (CPU(0), CPU(1), CPU(2), CPU(3))
    assert mesh.devices_along("dp", (0, 2)) == (CPU(2), CPU(6))
    assert mesh.devices_along(0, (1, 3)) == (CPU(3), CPU(7))
    assert mesh.devices_along(-1, (1, 3)) == (CPU(4), CPU(5), CPU(6), CPU(7))


def test_devices_along_does_not_mutate_coord(mesh: DeviceMesh) -> None:
    coord = [1, 2]
    mesh.devices_along("tp", coord)
    assert coord == [1, 2]


def test_devices_along_bad_input(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match="'pp'"):
        mesh.devices_along("pp", (0, 0))
    with pytest.raises(ShardingError, match=r"Coordinate \(0,\)"):
        mesh.devices_along("tp", (0,))


def test_groups(mesh: DeviceMesh) -> None:
    assert mesh.groups([1]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.groups([0]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.groups([0, 1]) == [list(range(8))]
    assert mesh.groups([1, 0]) == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert mesh.groups([]) == [[k] for k in range(8)]


def test_groups_by_name_and_negative_index(mesh: DeviceMesh) -> None:
    assert mesh.groups(["tp"]) == mesh.groups([1]) == mesh.groups([-1])
    assert mesh.groups(["dp"]) == mesh.groups([-2])


def test_groups_partition_devices() -> None:
    m = DeviceMesh.cpu((2, 3, 2), ("a", "b", "c"))
    for axes in ([0], [1], [2], [0, 2], [2, 0], [1, 2], [0, 1, 2]):
        groups = m.groups(axes)
        flat = sorted(k for g in groups for k in g)
        assert flat == list(range(12)), axes
        for g in groups:
            coords = [m.coord_of(k) for k in g]
            fixed = [a for a in range(3) if a not in axes]
            assert len({tuple(c[a] for a in fixed) for c in coords}) == 1


def test_groups_rejects_repeats_and_unknown(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match="twice"):
        mesh.groups(["tp", -1])
    with pytest.raises(ShardingError, match="'pp'"):
        mesh.groups(["pp"])
    with pytest.raises(ShardingError, match="index 5"):
        mesh.groups([5])


# --- current mesh ----------------------------------------------------------------------


def test_current_mesh_nesting(mesh: DeviceMesh) -> None:
    other = DeviceMesh.cpu(2, "x")
    assert current_mesh() is None
    with mesh as entered:
        assert entered is mesh
        assert current_mesh() is mesh
        with other:
            assert current_mesh() is other
            with mesh:
                assert current_mesh() is mesh
            assert current_mesh() is other
        assert current_mesh() is mesh
    assert current_mesh() is None


def test_current_mesh_restored_after_exception(mesh: DeviceMesh) -> None:
    with pytest.raises(RuntimeError), mesh:
        raise RuntimeError("boom")
    assert current_mesh() is None


def test_current_mesh_is_per_thread(mesh: DeviceMesh) -> None:
    seen: list[object] = []
    with mesh:
        t = threading.Thread(target=lambda: seen.append(current_mesh()))
        t.start()
        t.join()
    assert seen == [None]


# --- value semantics ------------------------------------------------------------------


def test_equality_and_hash(mesh: DeviceMesh) -> None:
    same = DeviceMesh.cpu((2, 4), ("dp", "tp"))
    assert mesh == same
    assert hash(mesh) == hash(same)
    assert len({mesh, same}) == 1
    assert mesh != DeviceMesh.cpu((2, 4), ("dp", "mp"))
    assert mesh != DeviceMesh.cpu((4, 2), ("dp", "tp"))
    assert mesh != DeviceMesh.cpu(8, "dp")
    shuffled = DeviceMesh(tuple(reversed(mesh.devices)), (2, 4), ("dp", "tp"))
    assert mesh != shuffled
    assert mesh != "DeviceMesh(dp=2, tp=4)"
    assert mesh != DeviceMesh((Accelerator(0), Accelerator(1)), (2,), ("x",))


def test_copy_and_pickle(mesh: DeviceMesh) -> None:
    for clone in (copy.copy(mesh), copy.deepcopy(mesh), pickle.loads(pickle.dumps(mesh))):
        assert clone == mesh
        assert hash(clone) == hash(mesh)
        assert repr(clone) == repr(mesh)
        assert clone.device_coord(CPU(5)) == (1, 1)
