"""Sharding forms: construction, validation, reprs and lossless conversions."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.sharding import (
    ConversionError,
    DeviceMesh,
    DimSpec,
    Layout,
    NamedMapping,
    Partial,
    PlacementMapping,
    ReduceOp,
    Replicated,
    Sharded,
    ShardingError,
    ShardingSpec,
    TensorLayout,
    as_layout,
)

R = Replicated()


@pytest.fixture
def mesh() -> DeviceMesh:
    return DeviceMesh.cpu((2, 3), ("dp", "tp"))


# --- reprs (DESIGN §2) ---------------------------------------------------------------------


def test_placement_mapping_repr() -> None:
    pm = PlacementMapping(DeviceMesh.cpu(4, "tp"), [Sharded(0)])
    assert repr(pm) == "PlacementMapping(DeviceMesh(tp=4), [Sharded(axis=0)])"
    pm2 = PlacementMapping(DeviceMesh.cpu((2, 2), ("dp", "tp")), [Partial("max"), R])
    assert repr(pm2) == (
        "PlacementMapping(DeviceMesh(dp=2, tp=2), [Partial(reduce_op='max'), Replicated()])"
    )


def test_named_mapping_repr(mesh: DeviceMesh) -> None:
    nm = NamedMapping(mesh, ("tp", None), unreduced={"dp"})
    assert repr(nm) == "NamedMapping(DeviceMesh(dp=2, tp=3), ('tp', None), unreduced={'dp'})"
    assert repr(NamedMapping(mesh, ("tp",))) == "NamedMapping(DeviceMesh(dp=2, tp=3), ('tp',))"
    assert repr(NamedMapping(mesh, (("dp", "tp"), None), priorities=(1, 0))) == (
        "NamedMapping(DeviceMesh(dp=2, tp=3), (('dp', 'tp'), None), priorities=(1, 0))"
    )
    assert repr(NamedMapping(mesh, (), unreduced={"tp", "dp"}, reduce_op="max")) == (
        "NamedMapping(DeviceMesh(dp=2, tp=3), (), unreduced={'dp', 'tp'}, reduce_op='max')"
    )


def test_dim_spec_repr() -> None:
    assert repr(DimSpec()) == "DimSpec(None)"
    assert repr(DimSpec("x")) == "DimSpec('x')"
    assert repr(DimSpec(("x",))) == "DimSpec('x')"
    assert repr(DimSpec(("x", "y"), is_open=True, priority=2)) == (
        "DimSpec(('x', 'y'), is_open=True, priority=2)"
    )


def test_sharding_spec_repr(mesh: DeviceMesh) -> None:
    spec = ShardingSpec(mesh, ["tp", None], partial_sum_axes={"dp"})
    assert repr(spec) == (
        "ShardingSpec(DeviceMesh(dp=2, tp=3), [DimSpec('tp'), DimSpec(None)], "
        "partial_sum_axes={'dp'})"
    )
    spec2 = ShardingSpec(mesh, [DimSpec(None, is_open=True)], replicated_axes="dp")
    assert repr(spec2) == (
        "ShardingSpec(DeviceMesh(dp=2, tp=3), [DimSpec(None, is_open=True)], "
        "replicated_axes={'dp'})"
    )


def test_layout_str(mesh: DeviceMesh) -> None:
    layout = NamedMapping(mesh, (None, ("tp",)), unreduced={"dp"}, reduce_op="min").to_layout(3)
    assert str(layout) == "DeviceMesh(dp=2, tp=3)[R, S(tp), R] partial dp:min"
    assert str(Layout.replicated(mesh, 1)) == "DeviceMesh(dp=2, tp=3)[R]"


# --- PlacementMapping ------------------------------------------------------------------------


def test_placement_mapping_normalises_and_is_a_value(mesh: DeviceMesh) -> None:
    pm = PlacementMapping(mesh, [Sharded(0), R])
    assert pm.placements == (Sharded(0), R)
    assert pm.mesh is mesh
    assert pm == PlacementMapping(mesh, (Sharded(0), Replicated()))
    assert hash(pm) == hash(PlacementMapping(mesh, (Sharded(0), Replicated())))
    assert pm != PlacementMapping(mesh, [Sharded(1), R])
    with pytest.raises(dataclasses.FrozenInstanceError):
        pm.placements = ()


def test_placement_mapping_wrong_count(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match=r"2 axes but 1 placements.*Sharded\(axis=0\)"):
        PlacementMapping(mesh, [Sharded(0)])
    with pytest.raises(ShardingError, match="2 axes but 3 placements"):
        PlacementMapping(mesh, [R, R, R])


def test_placement_mapping_rejects_non_placements(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match=r"Got 'R' \(str\)"):
        PlacementMapping(mesh, ["R", R])
    with pytest.raises(ShardingError, match=r"needs a DeviceMesh. Got \(2, 3\)"):
        PlacementMapping((2, 3), [R, R])


def test_placement_mapping_axis_out_of_range_for_rank(mesh: DeviceMesh) -> None:
    pm = PlacementMapping(mesh, [R, Sharded(2)])
    with pytest.raises(ShardingError, match=r"'tp' 2 is out of range for a tensor of rank 2"):
        pm.to_layout(2)
    assert pm.to_layout(3).dims == ((), (), (1,))


def test_placement_mapping_negative_axis(mesh: DeviceMesh) -> None:
    pm = PlacementMapping(mesh, [R, Sharded(-1)])
    assert pm.to_layout(3).dims == ((), (), (1,))
    assert pm.to_named_sharding(2) == NamedMapping(mesh, (None, "tp"))


def test_placement_mapping_conversions(mesh: DeviceMesh) -> None:
    pm = PlacementMapping(mesh, [Sharded(1), Sharded(0)])
    assert pm.to_placements() == (Sharded(1), Sharded(0))
    assert pm.to_named_sharding(2) == NamedMapping(mesh, ("tp", "dp"))
    assert pm.to_named_sharding(3) == NamedMapping(mesh, ("tp", "dp", None))
    assert pm.to_layout(2) == Layout(mesh, ((1,), (0,)), (None, None))


def test_placement_mapping_two_axes_on_one_dim_go_in_mesh_order(mesh: DeviceMesh) -> None:
    pm = PlacementMapping(mesh, [Sharded(0), Sharded(0)])
    assert pm.to_layout(1).dims == ((0, 1),)
    assert pm.to_named_sharding(1) == NamedMapping(mesh, (("dp", "tp"),))


@pytest.mark.parametrize("op", list(ReduceOp))
def test_partial_op_survives_every_conversion(mesh: DeviceMesh, op: ReduceOp) -> None:
    pm = PlacementMapping(mesh, [Partial(op), Sharded(0)])
    nm = pm.to_named_sharding(2)
    assert nm.unreduced == {"dp"}
    assert nm.reduce_op is op
    assert nm.spec == ("tp", None)
    assert nm.to_placements() == (Partial(op), Sharded(0))
    assert pm.to_layout(2).partial == (op, None)
    assert PlacementMapping(mesh, nm.to_placements()) == pm
    if op is ReduceOp.SUM:
        assert ShardingSpec.from_layout(pm.to_layout(2)).partial_sum_axes == {"dp"}
    else:
        with pytest.raises(ConversionError, match=f"'dp': '{op.value}'"):
            ShardingSpec.from_layout(pm.to_layout(2))


def test_mixed_partial_ops_cannot_become_named_mapping(mesh: DeviceMesh) -> None:
    pm = PlacementMapping(mesh, [Partial("max"), Partial("sum")])
    with pytest.raises(ConversionError, match=r"\{'dp': 'max', 'tp': 'sum'\}"):
        pm.to_named_sharding(1)
    # the canonical layout keeps both ops
    assert pm.to_layout(1).partial == (ReduceOp.MAX, ReduceOp.SUM)


def test_same_partial_op_on_two_axes_converts(mesh: DeviceMesh) -> None:
    pm = PlacementMapping(mesh, [Partial("min"), Partial("min")])
    nm = pm.to_named_sharding(1)
    assert nm == NamedMapping(mesh, (None,), unreduced={"dp", "tp"}, reduce_op=ReduceOp.MIN)
    assert nm.to_placements() == (Partial("min"), Partial("min"))


def test_is_fully_replicated(mesh: DeviceMesh) -> None:
    assert PlacementMapping(mesh, [R, R]).is_fully_replicated
    assert not PlacementMapping(mesh, [R, Sharded(0)]).is_fully_replicated
    assert not PlacementMapping(mesh, [Partial(), R]).is_fully_replicated
    assert NamedMapping(mesh, (None, None)).is_fully_replicated
    assert NamedMapping(mesh, ()).is_fully_replicated
    assert not NamedMapping(mesh, (None,), unreduced={"dp"}).is_fully_replicated
    assert not NamedMapping(mesh, ("dp",)).is_fully_replicated
    assert ShardingSpec(mesh, [None], replicated_axes={"dp", "tp"}).is_fully_replicated
    assert not ShardingSpec(mesh, [None], partial_sum_axes={"dp"}).is_fully_replicated
    assert not ShardingSpec(mesh, ["tp"]).is_fully_replicated
    assert Layout.replicated(mesh, 2).is_fully_replicated


# --- NamedMapping ----------------------------------------------------------------------------


def test_named_mapping_normalises(mesh: DeviceMesh) -> None:
    nm = NamedMapping(mesh, [("tp",), (), ("dp",)], unreduced=[])
    assert nm.spec == ("tp", None, "dp")
    assert nm.unreduced == frozenset()
    nm2 = NamedMapping(mesh, (None,), unreduced="dp", reduce_op="AVG")
    assert nm2.unreduced == frozenset({"dp"})
    assert nm2.reduce_op is ReduceOp.AVG
    assert NamedMapping(mesh, (["dp", "tp"],)).spec == (("dp", "tp"),)


def test_named_mapping_value_semantics(mesh: DeviceMesh) -> None:
    a = NamedMapping(mesh, ("tp", None), unreduced={"dp"})
    b = NamedMapping(mesh, [("tp",), None], unreduced=frozenset(["dp"]))
    assert a == b
    assert hash(a) == hash(b)
    assert a != NamedMapping(mesh, ("tp", None), unreduced={"dp"}, reduce_op="max")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.spec = ()


def test_named_mapping_unknown_axis(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match=r"Unknown mesh axis 'pp'.*\['dp', 'tp'\]"):
        NamedMapping(mesh, ("pp",))
    with pytest.raises(ShardingError, match="Unknown mesh axis 'pp'"):
        NamedMapping(mesh, (("dp", "pp"),))
    with pytest.raises(ShardingError, match="Unknown mesh axis 'pp'"):
        NamedMapping(mesh, (None,), unreduced={"pp"})


@pytest.mark.parametrize(
    ("spec", "unreduced"),
    [
        (("tp", "tp"), set()),
        ((("tp", "tp"),), set()),
        ((("dp", "tp"), "tp"), set()),
        (("tp", None), {"tp"}),
        ((("dp", "tp"),), {"dp"}),
    ],
)
def test_named_mapping_axis_used_twice(
    mesh: DeviceMesh, spec: tuple[object, ...], unreduced: set[str]
) -> None:
    with pytest.raises(ShardingError, match=r"mesh axis '(tp|dp)' is used twice"):
        NamedMapping(mesh, spec, unreduced=unreduced)


@pytest.mark.parametrize("bad", [1, True, ("tp", 2), {"tp"}, 1.5])
def test_named_mapping_non_str_axis(mesh: DeviceMesh, bad: object) -> None:
    with pytest.raises(ShardingError) as info:
        NamedMapping(mesh, (bad,))
    shown = bad[1] if isinstance(bad, tuple) else bad
    assert f"Got {shown!r}" in str(info.value)


@pytest.mark.parametrize("bad", [{1}, [["dp"]], [None]])
def test_named_mapping_non_str_unreduced(mesh: DeviceMesh, bad: object) -> None:
    with pytest.raises(ShardingError, match="unreduced holds mesh axis names") as info:
        NamedMapping(mesh, (None,), unreduced=bad)
    assert repr(next(iter(bad))) in str(info.value)


def test_named_mapping_spec_must_be_a_sequence(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match=r"Got 'tp'; write \('tp',\)"):
        NamedMapping(mesh, "tp")
    with pytest.raises(ShardingError, match="Got None"):
        NamedMapping(mesh, None)
    with pytest.raises(ShardingError, match="needs a DeviceMesh"):
        NamedMapping("mesh", ("tp",))


def test_named_mapping_priorities_validation(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match=r"priorities \(1, 2\) must give one int per spec"):
        NamedMapping(mesh, ("tp",), priorities=(1, 2))
    with pytest.raises(ShardingError, match="Got 'a'"):
        NamedMapping(mesh, ("tp",), priorities=("a",))
    with pytest.raises(ShardingError, match="Got True"):
        NamedMapping(mesh, ("tp",), priorities=(True,))


def test_named_mapping_bad_reduce_op(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match="Unknown reduce op 'bogus'"):
        NamedMapping(mesh, (None,), unreduced={"dp"}, reduce_op="bogus")


def test_named_mapping_to_layout(mesh: DeviceMesh) -> None:
    nm = NamedMapping(mesh, (("tp", "dp"),), unreduced=set(), reduce_op="sum")
    assert nm.to_layout(1) == Layout(mesh, ((1, 0),), (None, None))
    assert nm.to_layout(3) == Layout(mesh, ((1, 0), (), ()), (None, None))
    nm2 = NamedMapping(mesh, (None, "tp"), unreduced={"dp"}, reduce_op="prod")
    assert nm2.to_layout(2).partial == (ReduceOp.PROD, None)
    with pytest.raises(ShardingError, match="2 spec entries but the tensor has rank 1"):
        nm2.to_layout(1)


def test_named_mapping_to_placements(mesh: DeviceMesh) -> None:
    nm = NamedMapping(mesh, (None, "tp"), unreduced={"dp"}, reduce_op="avg")
    assert nm.to_placements() == (Partial("avg"), Sharded(1))
    assert NamedMapping(mesh, (("dp", "tp"),)).to_placements() == (Sharded(0), Sharded(0))
    # all-zero priorities are no priorities
    assert NamedMapping(mesh, ("dp",), priorities=(0,)).to_placements() == (Sharded(0), R)


def test_named_mapping_non_mesh_order_has_no_placements(mesh: DeviceMesh) -> None:
    nm = NamedMapping(mesh, (("tp", "dp"),))
    with pytest.raises(ConversionError, match=r"\('tp', 'dp'\).*not mesh order"):
        nm.to_placements()


def test_named_mapping_priorities_have_no_placements(mesh: DeviceMesh) -> None:
    nm = NamedMapping(mesh, ("dp", "tp"), priorities=(0, 1))
    with pytest.raises(ConversionError, match=r"priorities \(0, 1\)"):
        nm.to_placements()


def test_named_mapping_to_named_sharding(mesh: DeviceMesh) -> None:
    nm = NamedMapping(mesh, ("tp",), unreduced={"dp"}, reduce_op="max")
    assert nm.to_named_sharding(1) is nm
    wide = nm.to_named_sharding(3)
    assert wide == NamedMapping(mesh, ("tp", None, None), unreduced={"dp"}, reduce_op="max")
    assert wide.to_layout(3) == nm.to_layout(3)
    with_prio = NamedMapping(mesh, ("tp",), priorities=(2,)).to_named_sharding(2)
    assert with_prio.priorities == (2, 0)
    with pytest.raises(ShardingError, match="rank 0"):
        nm.to_named_sharding(0)


def test_named_mapping_from_layout(mesh: DeviceMesh) -> None:
    layout = Layout(mesh, ((), (1, 0)), (None, None))
    assert NamedMapping.from_layout(layout) == NamedMapping(mesh, (None, ("tp", "dp")))
    layout2 = Layout(mesh, ((1,),), (ReduceOp.MIN, None))
    nm = NamedMapping.from_layout(layout2)
    assert nm.unreduced == {"dp"}
    assert nm.reduce_op is ReduceOp.MIN
    assert nm.to_layout(1) == layout2
    mixed = Layout(mesh, ((),), (ReduceOp.MIN, ReduceOp.MAX))
    with pytest.raises(ConversionError, match="different reduce ops"):
        NamedMapping.from_layout(mixed)


# --- DimSpec -----------------------------------------------------------------------------------


def test_dim_spec_forms() -> None:
    assert DimSpec().axes == ()
    assert DimSpec(None).axes == ()
    assert DimSpec("x").axes == ("x",)
    assert DimSpec(["x", "y"]).axes == ("x", "y")
    assert DimSpec("x") == DimSpec(("x",))
    assert DimSpec.of("x") == DimSpec(("x",))
    assert DimSpec.of(None) == DimSpec()
    d = DimSpec(("x",), is_open=True)
    assert DimSpec.of(d) is d
    assert DimSpec((), is_open=1).is_open is True
    assert hash(DimSpec("x")) == hash(DimSpec(("x",)))
    assert DimSpec("x") != DimSpec("x", is_open=True)
    assert DimSpec("x") != DimSpec("x", priority=1)


def test_dim_spec_validation() -> None:
    with pytest.raises(ShardingError, match="Got 3"):
        DimSpec(3)
    with pytest.raises(ShardingError, match=r"axis names \(str\). Got 1"):
        DimSpec(("x", 1))
    with pytest.raises(ShardingError, match="'x' is used twice"):
        DimSpec(("x", "x"))
    with pytest.raises(ShardingError, match=r"priority must be an int\. Got 1\.5"):
        DimSpec(("x",), priority=1.5)
    with pytest.raises(ShardingError, match="Got True"):
        DimSpec(("x",), priority=True)


# --- ShardingSpec ------------------------------------------------------------------------------


def test_sharding_spec_construction(mesh: DeviceMesh) -> None:
    spec = ShardingSpec(mesh, [None, "tp", ("dp",)], replicated_axes=None)
    assert spec.dim_specs == (DimSpec(), DimSpec(("tp",)), DimSpec(("dp",)))
    assert spec.replicated_axes == frozenset()
    assert spec.partial_sum_axes == frozenset()
    assert spec.open_dims == (False, False, False)
    assert spec == ShardingSpec(mesh, (DimSpec(), DimSpec(("tp",)), DimSpec(("dp",))))
    assert hash(spec) == hash(ShardingSpec(mesh, [DimSpec(), "tp", "dp"]))
    spec2 = ShardingSpec(
        mesh, [DimSpec(is_open=True)], replicated_axes={"dp"}, partial_sum_axes=["tp"]
    )
    assert spec2.open_dims == (True,)
    assert spec2.replicated_axes == {"dp"}
    assert spec2.partial_sum_axes == {"tp"}


def test_sharding_spec_unknown_axis(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match="Unknown mesh axis 'pp'"):
        ShardingSpec(mesh, ["pp"])
    with pytest.raises(ShardingError, match="Unknown mesh axis 'pp'"):
        ShardingSpec(mesh, [None], replicated_axes={"pp"})
    with pytest.raises(ShardingError, match="Unknown mesh axis 'pp'"):
        ShardingSpec(mesh, [None], partial_sum_axes={"pp"})


@pytest.mark.parametrize(
    ("dims", "rep", "part", "name"),
    [
        (["tp", "tp"], set(), set(), "tp"),
        ([("dp", "tp"), "dp"], set(), set(), "dp"),
        (["tp"], {"tp"}, set(), "tp"),
        (["tp"], set(), {"tp"}, "tp"),
        ([None], {"dp"}, {"dp"}, "dp"),
    ],
)
def test_sharding_spec_axis_used_twice(
    mesh: DeviceMesh, dims: list[object], rep: set[str], part: set[str], name: str
) -> None:
    with pytest.raises(ShardingError, match=f"mesh axis '{name}' is used twice"):
        ShardingSpec(mesh, dims, replicated_axes=rep, partial_sum_axes=part)


def test_sharding_spec_non_str_axes(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match="Got 0"):
        ShardingSpec(mesh, [(0,)])
    with pytest.raises(ShardingError, match=r"replicated_axes holds mesh axis names.*Got 1"):
        ShardingSpec(mesh, [None], replicated_axes={1})


@pytest.mark.parametrize("bad", ["tp", None, DimSpec(("tp",))])
def test_sharding_spec_dim_specs_must_be_a_list(mesh: DeviceMesh, bad: object) -> None:
    with pytest.raises(ShardingError, match="wrap it in a list") as info:
        ShardingSpec(mesh, bad)
    assert repr(bad) in str(info.value)


def test_sharding_spec_to_layout(mesh: DeviceMesh) -> None:
    spec = ShardingSpec(mesh, [("tp", "dp"), None])
    assert spec.to_layout(2) == Layout(mesh, ((1, 0), ()), (None, None))
    spec2 = ShardingSpec(mesh, [None], partial_sum_axes={"tp"})
    assert spec2.to_layout(1).partial == (None, ReduceOp.SUM)
    with pytest.raises(ShardingError, match="2 dim specs but the tensor has rank 3"):
        spec.to_layout(3)


def test_sharding_spec_open_dims_do_not_convert(mesh: DeviceMesh) -> None:
    spec = ShardingSpec(mesh, [DimSpec(("tp",), is_open=True), None])
    with pytest.raises(ConversionError, match=r"Dims \[0\] .* are open"):
        spec.to_placements()
    with pytest.raises(ConversionError, match="are open"):
        spec.to_named_sharding(2)
    # the layout itself is well defined
    assert spec.to_layout(2).dims == ((1,), ())


def test_sharding_spec_priorities(mesh: DeviceMesh) -> None:
    spec = ShardingSpec(mesh, [DimSpec(("tp",), priority=1), None])
    with pytest.raises(ConversionError, match="priorities"):
        spec.to_placements()
    nm = spec.to_named_sharding(2)
    assert nm == NamedMapping(mesh, ("tp", None), priorities=(1, 0))
    with pytest.raises(ConversionError, match="priorities"):
        nm.to_placements()


def test_sharding_spec_conversions(mesh: DeviceMesh) -> None:
    spec = ShardingSpec(mesh, ["tp", None], partial_sum_axes={"dp"})
    assert spec.to_placements() == (Partial("sum"), Sharded(0))
    assert spec.to_named_sharding(2) == NamedMapping(mesh, ("tp", None), unreduced={"dp"})
    non_mesh_order = ShardingSpec(mesh, [("tp", "dp")])
    with pytest.raises(ConversionError, match="not mesh order"):
        non_mesh_order.to_placements()
    assert non_mesh_order.to_named_sharding(1) == NamedMapping(mesh, (("tp", "dp"),))


def test_sharding_spec_from_layout(mesh: DeviceMesh) -> None:
    layout = Layout(mesh, ((), (1, 0)), (None, None))
    assert ShardingSpec.from_layout(layout) == ShardingSpec(mesh, [None, ("tp", "dp")])
    summed = Layout(mesh, ((1,),), (ReduceOp.SUM, None))
    spec = ShardingSpec.from_layout(summed)
    assert spec.partial_sum_axes == {"dp"}
    assert spec.to_layout(1) == summed
    with pytest.raises(ConversionError, match=r"\{'tp': 'avg'\}"):
        ShardingSpec.from_layout(Layout(mesh, ((),), (ReduceOp.SUM, ReduceOp.AVG)))


# --- Layout --------------------------------------------------------------------------------


def test_layout_validation(mesh: DeviceMesh) -> None:
    with pytest.raises(ShardingError, match=r"one entry per mesh axis \(2\). Got 1"):
        Layout(mesh, ((),), (None,))
    with pytest.raises(ShardingError, match="'tp' is used twice"):
        Layout(mesh, ((1,), (1,)), (None, None))
    with pytest.raises(ShardingError, match="'dp' is used twice"):
        Layout(mesh, ((0, 0),), (None, None))
    with pytest.raises(ShardingError, match="'tp' cannot both shard tensor dim 0 and be Partial"):
        Layout(mesh, ((1,),), (None, ReduceOp.SUM))
    with pytest.raises(ShardingError, match="mesh axis 2 out of range"):
        Layout(mesh, ((2,),), (None, None))


def test_layout_queries(mesh: DeviceMesh) -> None:
    layout = Layout(mesh, ((), (1,)), (ReduceOp.MAX, None))
    assert layout.ndim == 2
    assert layout.dim_of_axis(1) == 1
    assert layout.dim_of_axis(0) is None
    assert layout.sharded_axes == (1,)
    assert layout.partial_axes == (0,)
    assert layout.is_partial
    assert not layout.is_fully_replicated
    assert layout.placement(0) == Partial("max")
    assert layout.placement(1) == Sharded(1)
    assert Layout.replicated(mesh, 1).placement(0) == R
    assert hash(layout) == hash(Layout(mesh, ((), (1,)), (ReduceOp.MAX, None)))


def test_as_layout(mesh: DeviceMesh) -> None:
    expected = Layout(mesh, ((1,), ()), (ReduceOp.SUM, None))
    assert as_layout(PlacementMapping(mesh, [Partial(), Sharded(0)]), 2) == expected
    assert as_layout(NamedMapping(mesh, ("tp",), unreduced={"dp"}), 2) == expected
    assert as_layout(ShardingSpec(mesh, ["tp", None], partial_sum_axes={"dp"}), 2) == expected
    assert as_layout(expected, 2) is expected
    with pytest.raises(ShardingError, match="is for rank 2, the tensor has rank 3"):
        as_layout(expected, 3)
    with pytest.raises(ShardingError, match=r"Got \[Sharded\(axis=0\)\] \(list\)"):
        as_layout([Sharded(0)], 1)


def test_tensor_layout(mesh: DeviceMesh) -> None:
    tl = TensorLayout("float32", [4, 6], NamedMapping(mesh, ("dp", "tp")))
    assert tl.shape == (4, 6)
    assert tl.rank == 2
    assert tl.layout == Layout(mesh, ((0,), (1,)), (None, None))
    with pytest.raises(ShardingError, match=r"Got \[Sharded\(axis=0\)\]"):
        TensorLayout("float32", (4,), [Sharded(0)])
    with pytest.raises(ShardingError, match="Got -1"):
        TensorLayout("float32", (4, -1), NamedMapping(mesh, ()))
