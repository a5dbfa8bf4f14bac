"""DeviceMesh.submesh: a pipeline stage's slice of a mesh."""

import pytest

from shardwise import DeviceMesh
from shardwise.sharding.errors import ShardingError


def test_submesh_keeps_the_other_axes_in_order() -> None:
    mesh = DeviceMesh.cpu((2, 3, 2), ("pp", "dp", "tp"))
    for p in range(2):
        sub = mesh.submesh(pp=p)
        assert sub.axis_names == ("dp", "tp") and sub.mesh_shape == (3, 2)
        for k, dev in enumerate(sub.devices):
            d, t = sub.coord_of(k)
            assert mesh.device_coord(dev) == (p, d, t)
    two = mesh.submesh(pp=1, tp=0)
    assert two.axis_names == ("dp",)
    assert [mesh.device_coord(d) for d in two.devices] == [(1, 0, 0), (1, 1, 0), (1, 2, 0)]


@pytest.mark.parametrize("coords, match", [
    ({"pp": 2}, r"pp=2.*\[0, 2\)"), ({"xx": 0}, "Unknown mesh axis 'xx'"),
    ({}, "at least one"), ({"pp": 0, "dp": 0, "tp": 0}, "every axis"),
    ({"pp": True}, "must be an int")])
def test_submesh_refuses_bad_coordinates(coords: dict, match: str) -> None:
    mesh = DeviceMesh.cpu((2, 3, 2), ("pp", "dp", "tp"))
    with pytest.raises(ShardingError, match=match):
        mesh.submesh(**coords)


def test_two_stages_submeshes_read_apart() -> None:
    """A submesh's repr names its devices (stage 1's is not stage 0's), a whole mesh's
    stays the axes alone; an error about two stages' meshes so tells them apart."""
    mesh = DeviceMesh.cpu((2, 2, 2), ("pp", "dp", "tp"))
    assert repr(mesh) == "DeviceMesh(pp=2, dp=2, tp=2)"
    assert repr(mesh.submesh(pp=0)) == "DeviceMesh(dp=2, tp=2)"
    assert repr(mesh.submesh(pp=1)) == "DeviceMesh(dp=2, tp=2; devices 4..7)"
    assert repr(mesh.submesh(dp=1)) == "DeviceMesh(pp=2, tp=2; devices [2, 3, 6, 7])"
