"""Properties of the spec algebra over random meshes, shapes and layouts (hypothesis)."""

from __future__ import annotations

import copy
import itertools
import math
import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise.sharding as sharding
from shardwise.sharding import (
    ConversionError,
    DeviceMesh,
    Layout,
    NamedMapping,
    Partial,
    Placement,
    PlacementMapping,
    ReduceOp,
    Replicated,
    Sharded,
    ShardingSpec,
    global_shape_from_local,
    local_shard_shape_from_global,
)
from shardwise.sharding.devices import CPU
from shardwise.sharding.shapes import local_bounds, local_shape, split_bounds, split_size

NAMES = ("dp", "tp", "pp", "x", "y")
FAST = settings(max_examples=250, deadline=None)


@dataclass(frozen=True)
class Case:
    mesh: DeviceMesh
    shape: tuple[int, ...]
    layout: Layout


@st.composite
def meshes(draw: st.DrawFn) -> DeviceMesh:
    ndim = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
    names = draw(st.permutations(NAMES))[:ndim]
    return DeviceMesh.cpu(tuple(sizes), tuple(names))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A random mesh, tensor shape and layout: each mesh axis is replicated, partial
    with a random op, or shards a random dim; several axes on one dim in random order."""
    mesh = draw(meshes())
    rank = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=rank, max_size=rank)))
    dims: list[list[int]] = [[] for _ in range(rank)]
    partial: list[ReduceOp | None] = [None] * mesh.ndim
    kinds = ["R", "P", "S", "S"] if rank else ["R", "P"]
    # dim 0 is drawn often so that several mesh axes often share one dim
    dim = st.one_of(st.just(0), st.integers(0, max(rank - 1, 0)))
    for a in draw(st.permutations(range(mesh.ndim))):
        kind = draw(st.sampled_from(kinds))
        if kind == "P":
            partial[a] = draw(st.sampled_from(list(ReduceOp)))
        elif kind == "S":
            dims[draw(dim)].append(a)
    return Case(mesh, shape, Layout(mesh, tuple(tuple(d) for d in dims), tuple(partial)))


def mesh_order(layout: Layout) -> Layout:
    """The same assignment of axes to dims with every multi-axis dim in mesh order."""
    return layout.with_dims(tuple(tuple(sorted(axes)) for axes in layout.dims))


# --- (a) per-device blocks tile the global shape --------------------------------------------


@FAST
@given(cases())
def test_blocks_tile_the_global_shape(case: Case) -> None:
    mesh, shape, layout = case.mesh, case.shape, case.layout
    unsharded = [a for a in range(mesh.ndim) if layout.dim_of_axis(a) is None]
    groups = mesh.groups(unsharded)
    assert len(groups) == math.prod(mesh.mesh_shape[a] for a in layout.sharded_axes)
    covered: set[tuple[int, ...]] = set()
    volume = 0
    for group in groups:
        blocks = {local_bounds(shape, layout, mesh.coord_of(k)) for k in group}
        assert len(blocks) == 1  # replicated / partial copies hold the same block
        (block,) = blocks
        cells = list(itertools.product(*(range(lo, hi) for lo, hi in block)))
        volume += len(cells)
        assert covered.isdisjoint(cells)
        covered.update(cells)
    assert volume == math.prod(shape)
    assert covered == set(itertools.product(*(range(s) for s in shape)))


@FAST
@given(cases())
def test_blocks_follow_the_split_rule(case: Case) -> None:
    """Device coordinate (i, j) over axes (a, b) holds piece i * size(b) + j, sized by the rule."""
    mesh, shape, layout = case.mesh, case.shape, case.layout
    for k in range(mesh.num_devices):
        coord = mesh.coord_of(k)
        bounds = local_bounds(shape, layout, coord)
        assert local_shape(shape, layout, coord) == tuple(hi - lo for lo, hi in bounds)
        for d, axes in enumerate(layout.dims):
            n = math.prod(mesh.mesh_shape[a] for a in axes)
            piece = 0
            for a in axes:
                piece = piece * mesh.mesh_shape[a] + coord[a]
            g = shape[d]
            sizes = [g // n + (1 if p < g % n else 0) for p in range(n)]
            start = sum(sizes[:piece])
            assert bounds[d] == (start, start + sizes[piece])


@FAST
@given(st.integers(0, 50), st.integers(1, 12))
def test_split_rule(size: int, n: int) -> None:
    sizes = [split_size(size, n, k) for k in range(n)]
    assert sum(sizes) == size
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    bounds = [split_bounds(size, n, k) for k in range(n)]
    assert [b - a for a, b in bounds] == sizes
    assert [a for a, _ in bounds] == [sum(sizes[:k]) for k in range(n)]


# --- (b) local shapes sum back to the global shape -------------------------------------------


@FAST
@given(cases())
def test_local_shapes_sum_to_global(case: Case) -> None:
    mesh, shape = case.mesh, case.shape
    layout = mesh_order(case.layout)
    placements = layout.to_placements()
    shapes = local_shard_shape_from_global(shape, mesh, placements)
    assert len(shapes) == mesh.num_devices
    for d, axes in enumerate(layout.dims):
        if not axes:
            assert all(s[d] == shape[d] for s in shapes)
            continue
        others = [a for a in range(mesh.ndim) if a not in axes]
        for group in mesh.groups(axes):
            assert sum(shapes[k][d] for k in group) == shape[d]
            # the group varies only over the dim's axes
            assert len({tuple(mesh.coord_of(k)[a] for a in others) for k in group}) == 1
    # every device's shape recovers the exact global shape given all shapes
    for s in set(shapes):
        assert global_shape_from_local(s, mesh, placements, local_shapes=shapes) == shape


@FAST
@given(cases())
def test_global_from_local_inverts_even_splits(case: Case) -> None:
    mesh = case.mesh
    layout = mesh_order(case.layout)
    # scale the shape so that every sharded dim splits evenly
    shape = tuple(
        s * math.prod(mesh.mesh_shape[a] for a in axes)
        for s, axes in zip(case.shape, layout.dims, strict=True)
    )
    placements = layout.to_placements()
    for s in local_shard_shape_from_global(shape, mesh, placements):
        assert global_shape_from_local(s, mesh, placements) == shape


# --- (c) conversions round-trip or raise exactly when they must --------------------------------


@FAST
@given(cases())
def test_round_trip_through_placements(case: Case) -> None:
    layout, ndim = case.layout, len(case.shape)
    must_fail = any(list(axes) != sorted(axes) for axes in layout.dims)
    try:
        placements = layout.to_placements()
    except ConversionError:
        assert must_fail
        return
    assert not must_fail
    pm = PlacementMapping(case.mesh, placements)
    assert pm.to_layout(ndim) == layout
    assert Layout.from_placements(case.mesh, placements, ndim) == layout
    for a, p in enumerate(placements):
        assert layout.partial[a] == (p.reduce_op if isinstance(p, Partial) else None)


@FAST
@given(cases())
def test_round_trip_through_named_mapping(case: Case) -> None:
    layout, ndim = case.layout, len(case.shape)
    must_fail = len({op for op in layout.partial if op is not None}) > 1
    try:
        nm = NamedMapping.from_layout(layout)
    except ConversionError:
        assert must_fail
        return
    assert not must_fail
    assert nm.to_layout(ndim) == layout
    assert nm.unreduced == {case.mesh.axis_names[a] for a in layout.partial_axes}
    if layout.is_partial:
        assert {nm.reduce_op} == {op for op in layout.partial if op is not None}
    # via PlacementMapping.to_named_sharding as well, where placements exist
    if all(list(axes) == sorted(axes) for axes in layout.dims):
        pm = PlacementMapping(case.mesh, layout.to_placements())
        assert pm.to_named_sharding(ndim) == nm
        assert nm.to_placements() == pm.placements


@FAST
@given(cases())
def test_round_trip_through_sharding_spec(case: Case) -> None:
    layout, ndim = case.layout, len(case.shape)
    must_fail = any(op not in (None, ReduceOp.SUM) for op in layout.partial)
    try:
        spec = ShardingSpec.from_layout(layout)
    except ConversionError:
        assert must_fail
        return
    assert not must_fail
    assert spec.to_layout(ndim) == layout
    assert spec.partial_sum_axes == {case.mesh.axis_names[a] for a in layout.partial_axes}
    assert spec.to_named_sharding(ndim).to_layout(ndim) == layout


@FAST
@given(cases())
def test_placement_mapping_to_named_mapping_keeps_reduce_ops(case: Case) -> None:
    layout, ndim = mesh_order(case.layout), len(case.shape)
    pm = PlacementMapping(case.mesh, layout.to_placements())
    ops = {op for op in layout.partial if op is not None}
    try:
        nm = pm.to_named_sharding(ndim)
    except ConversionError:
        assert len(ops) > 1
        return
    assert len(ops) <= 1
    assert nm.to_layout(ndim).partial == layout.partial
    assert PlacementMapping(case.mesh, nm.to_placements()) == pm


# --- (d) reprs are stable ----------------------------------------------------------------------

placements_st: st.SearchStrategy[Placement] = st.one_of(
    st.just(Replicated()),
    st.builds(Sharded, st.integers(-4, 4)),
    st.builds(Partial, st.sampled_from(list(ReduceOp))),
    st.builds(Partial, st.sampled_from(["sum", "AVG", "Min", "max", "PROD"])),
)


@FAST
@given(placements_st)
def test_placement_repr_evals_back(p: Placement) -> None:
    ns = {name: getattr(sharding, name) for name in sharding.__all__} | {"CPU": CPU}
    assert eval(repr(p), ns) == p
    assert hash(eval(repr(p), ns)) == hash(p)


@FAST
@given(cases(), st.randoms(use_true_random=False))
def test_mapping_reprs_are_stable(case: Case, rnd: random.Random) -> None:
    mesh, layout = case.mesh, case.layout
    forms: list[object] = [layout]
    if all(list(axes) == sorted(axes) for axes in layout.dims):
        forms.append(PlacementMapping(mesh, layout.to_placements()))
    try:
        nm = NamedMapping.from_layout(layout)
    except ConversionError:
        pass
    else:
        forms.append(nm)
        # the repr does not depend on how the unreduced set was built
        names = list(nm.unreduced)
        rnd.shuffle(names)
        again = NamedMapping(mesh, list(nm.spec), unreduced=names, reduce_op=nm.reduce_op)
        assert repr(again) == repr(nm)
        assert again == nm
    try:
        spec = ShardingSpec.from_layout(layout)
    except ConversionError:
        pass
    else:
        forms.append(spec)
    for x in forms:
        clone = copy.deepcopy(x)
        assert clone == x
        assert hash(clone) == hash(x)
        assert repr(clone) == repr(x)
        assert str(clone) == str(x)
        assert repr(mesh) in repr(x)


# --- meshes --------------------------------------------------------------------------------------


@FAST
@given(meshes())
def test_mesh_coordinates_round_trip(mesh: DeviceMesh) -> None:
    coords = [mesh.coord_of(k) for k in range(mesh.num_devices)]
    assert coords == list(itertools.product(*(range(s) for s in mesh.mesh_shape)))
    for k, dev in enumerate(mesh.devices):
        assert mesh.index_of(mesh.device_coord(dev)) == k
    for a in range(mesh.ndim):
        along = mesh.devices_along(a, coords[-1])
        assert len(along) == mesh.mesh_shape[a]
        assert [mesh.device_coord(d)[a] for d in along] == list(range(mesh.mesh_shape[a]))


@FAST
@given(meshes(), st.data())
def test_mesh_groups_partition(mesh: DeviceMesh, data: st.DataObject) -> None:
    axes = data.draw(st.permutations(range(mesh.ndim)))
    axes = axes[: data.draw(st.integers(0, mesh.ndim))]
    groups = mesh.groups(axes)
    assert sorted(k for g in groups for k in g) == list(range(mesh.num_devices))
    assert all(len(g) == math.prod(mesh.mesh_shape[a] for a in axes) for g in groups)
    for g in groups:
        subs = [tuple(mesh.coord_of(k)[a] for a in axes) for k in g]
        assert subs == sorted(subs)  # row-major over the given axes
    assert mesh.groups([mesh.axis_names[a] for a in axes]) == groups
