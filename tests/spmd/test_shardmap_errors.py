"""shard_map and lax errors: clear messages, raised in the caller, never a hang."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import PlacementMapping, Sharded, ShardingError, lax
from tests.helpers.meshes import M4 as MESH
from tests.helpers.meshes import M22 as MESH2

X = torch.arange(24.0).reshape(8, 3)


def smap(fn: Any, in_specs: Any = (("x",),), out_specs: Any = ("x",), **kw: Any) -> Any:
    return sw.shard_map(fn, MESH, in_specs, out_specs, **kw)


@pytest.mark.parametrize("call", [
    lambda: lax.psum(X, "x"), lambda: lax.pmean(X, "x"), lambda: lax.pmax(X, "x"),
    lambda: lax.pmin(X, "x"), lambda: lax.all_gather(X, "x"),
    lambda: lax.psum_scatter(X, "x"), lambda: lax.ppermute(X, "x", [(0, 1)]),
    lambda: lax.all_to_all(X, "x", 0, 1), lambda: lax.axis_index("x"),
    lambda: lax.axis_size("x"),
])
def test_lax_outside_shard_map(call: Any) -> None:
    with pytest.raises(ShardingError, match="outside shard_map"):
        call()


def test_wrong_number_of_in_specs() -> None:
    with pytest.raises(ShardingError, match=r"2 argument\(s\) but in_specs has 1"):
        smap(lambda a, b: a, in_specs=(("x",),))(X, X)


def test_single_spec_for_several_arguments_hints() -> None:
    with pytest.raises(ShardingError, match=r"not a spec.*write \('x',\)"):
        smap(lambda a, b: a, in_specs=("x", None))(X, X)


def test_wrong_number_of_out_specs() -> None:
    with pytest.raises(ShardingError, match="tuple of 2 outputs but out_specs"):
        smap(lambda a: (a, a), out_specs=(("x",), ("x",), ("x",)))(X)


def test_missing_specs() -> None:
    with pytest.raises(ShardingError, match="needs in_specs"):
        sw.shard_map(lambda a: a, MESH, out_specs=None)


@pytest.mark.parametrize("in_specs, out_specs", [((("y",),), ("x",)), ((("x",),), ("y", None)),
                                                 ((None,), (("x", "y"),))])
def test_unknown_axis_in_specs_raises_at_definition(in_specs: Any, out_specs: Any) -> None:
    with pytest.raises(ShardingError, match="unknown mesh axis 'y'"):
        sw.shard_map(lambda a: a, MESH, in_specs, out_specs)


def test_spec_on_another_mesh() -> None:
    with pytest.raises(ShardingError, match="shard_map runs on"):
        sw.shard_map(lambda a: a, MESH, (PlacementMapping(MESH2, [Sharded(0)] * 2),), None)


def test_unknown_axis_inside_fn() -> None:
    with pytest.raises(ShardingError, match=r"unknown mesh axis 'tp'.*\['x'\]"):
        smap(lambda a: lax.psum(a, "tp"))(X)
    with pytest.raises(ShardingError, match="names a mesh axis twice"):
        sw.shard_map(lambda a: lax.psum(a, ("dp", "dp")), MESH2, (None,), None)(X)
    with pytest.raises(ShardingError, match="axis_name is a mesh axis name"):
        smap(lambda a: lax.psum(a, 0))(X)


def test_out_spec_inconsistent_with_blocks() -> None:
    # blocks of 1, 2, 3, 4 rows are no split of 10 rows (that would be 3, 3, 2, 2)
    with pytest.raises(ShardingError, match="split rule"):
        smap(lambda a: a[: lax.axis_index("x") + 1], in_specs=(None,))(X)
    # replicated dims must agree
    with pytest.raises(ShardingError, match="other dims must agree"):
        smap(lambda a: a[:, : lax.axis_index("x") + 1])(X)
    with pytest.raises(ShardingError, match="one rank and one dtype"):
        smap(lambda a: a if lax.axis_index("x") else a.double())(X)
    with pytest.raises(ShardingError, match="out_specs = \\('x', None, None\\) does not fit"):
        smap(lambda a: a, out_specs=("x", None, None))(X)


def test_exception_in_one_device_is_reraised_without_hanging() -> None:
    def fn(a: torch.Tensor) -> torch.Tensor:
        if lax.axis_index("x") == 2:
            raise ValueError("boom on device 2")
        return lax.psum(a, "x")

    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on device 2") as info:
        smap(fn, out_specs=None, timeout_s=30)(X)
    assert time.monotonic() - start < 10
    assert "CPU(2)" in "".join(getattr(info.value, "__notes__", []))
    # the runtime is clean afterwards
    assert torch.equal(smap(lambda a: a * 2)(X).to_torch(), X * 2)


def test_devices_calling_different_collectives() -> None:
    def fn(a: torch.Tensor) -> torch.Tensor:
        if lax.axis_index("x") == 1:
            return lax.pmax(a, "x")
        return lax.psum(a, "x")

    with pytest.raises(ShardingError, match=r"different calls at collective #0.*CPU\(1\): pmax"):
        smap(fn, out_specs=None, timeout_s=30)(X)


def test_device_skipping_a_collective() -> None:
    def fn(a: torch.Tensor) -> torch.Tensor:
        return a if lax.axis_index("x") == 3 else lax.psum(a, "x")

    start = time.monotonic()
    with pytest.raises(ShardingError, match="returned from fn"):
        smap(fn, out_specs=None, timeout_s=30)(X)
    assert time.monotonic() - start < 10


def test_stuck_device_times_out() -> None:
    def fn(a: torch.Tensor) -> torch.Tensor:
        if lax.axis_index("x") == 0:
            time.sleep(1.0)
        return lax.psum(a, "x")

    start = time.monotonic()
    with pytest.raises(ShardingError, match=r"timeout_s=0.2 s.*CPU\(0\)': running fn|"
                                            r"timeout_s=0.2 s"):
        smap(fn, out_specs=None, timeout_s=0.2)(X)
    assert time.monotonic() - start < 10


def test_group_shapes_must_match() -> None:
    with pytest.raises(ShardingError, match=r"lax.psum over \('x',\).*same shape"):
        sw.shard_map(lambda a: lax.psum(a, "x"), MESH, (("x",),), None)(torch.ones(5, 2))
    with pytest.raises(ShardingError, match="same shape except dim 0"):
        sw.shard_map(lambda a: lax.all_gather(a[:, : lax.axis_index("x") + 1], "x",
                                              tiled=True), MESH, (("x",),), None)(X)


def test_untiled_sizes_and_permutations_are_checked() -> None:
    with pytest.raises(ShardingError, match=r"psum_scatter\(tiled=False\) needs x.shape\[0\]"):
        smap(lambda a: lax.psum_scatter(a, "x", tiled=False), out_specs=None)(X)
    with pytest.raises(ShardingError, match=r"all_to_all\(tiled=False\)"):
        smap(lambda a: lax.all_to_all(a, "x", 1, 0, tiled=False))(X)
    with pytest.raises(ShardingError, match="a destination appears twice"):
        smap(lambda a: lax.ppermute(a, "x", [(0, 1), (2, 1)]))(X)
    with pytest.raises(ShardingError, match="source 4 is out of range"):
        smap(lambda a: lax.ppermute(a, "x", [(4, 1)]))(X)
    with pytest.raises(ShardingError, match="int pairs"):
        smap(lambda a: lax.ppermute(a, "x", [0, 1]))(X)
    with pytest.raises(ShardingError, match="out of range"):
        smap(lambda a: lax.all_gather(a, "x", axis=3))(X)


WRITES = {
    "mul_": lambda a: a.mul_(2),
    "setitem": lambda a: a.__setitem__(0, 5.0),
    "view zero_": lambda a: a[0].zero_(),
    "detached fill_": lambda a: a.detach().fill_(1.0),
    "copy_": lambda a: a.copy_(torch.zeros_like(a)),
    "out=": lambda a: torch.add(a.detach(), 1, out=a.detach()),
    "after a collective": lambda a: (lax.psum(a, "x").add_(1), a.sub_(1))[1],
}


@pytest.mark.parametrize("name", list(WRITES))
@pytest.mark.parametrize("spec", [("x",), None])
def test_fn_writing_to_an_input_is_stopped_before_the_write(name: str, spec: Any) -> None:
    """Sharded and replicated inputs, torch and shardwise callers: the error comes
    before the write, so the caller's tensors are intact afterwards."""
    caller = X.clone()
    t = sw.tensor(X.clone(), sharding=PlacementMapping(MESH, [Sharded(0)]))
    before = [s.clone() for s in t.shards]
    for arg in (caller, t):
        with pytest.raises(ShardingError, match=r"about to write to argument 0's local block"):
            smap(WRITES[name], in_specs=(spec,), out_specs=spec)(arg)
    assert torch.equal(caller, X)
    assert all(torch.equal(s, b) for s, b in zip(t.shards, before))
    assert torch.equal(t.to_torch(), X)


def test_fn_may_write_to_its_own_tensors() -> None:
    """No false alarms: writes to clones, fresh tensors and collective results pass."""

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        c = a.clone()
        c.mul_(2)
        out = torch.empty_like(a)
        torch.add(c, b, out=out)
        s = lax.psum(out, "x")
        s.add_(1)
        empty = a[:0]
        empty.zero_() if empty.numel() else None
        return s

    got = smap(fn, in_specs=(("x",), ("x",)), out_specs=None)(X, X + 1)
    assert torch.allclose(got.to_torch(), (3 * X + 1).reshape(4, 2, 3).sum(0) + 1)
    assert torch.equal(X, torch.arange(24.0).reshape(8, 3))


def test_bad_values_and_calls() -> None:
    with pytest.raises(sw.ShardingError, match=r"takes the local block, a torch\.Tensor"):
        smap(lambda a: lax.psum(sw.tensor(a), "x"))(X)
    with pytest.raises(TypeError, match="returned a str"):
        smap(lambda a: "no")(X)
    with pytest.raises(TypeError, match="positional arguments only"):
        smap(lambda a: a)(a=X)
    with pytest.raises(TypeError, match="not a tensor"):
        smap(lambda a: a)(object())
    with pytest.raises(ShardingError, match="needs a DeviceMesh"):
        sw.shard_map(lambda a: a, None, (None,), None)
    with pytest.raises(ShardingError, match="nesting is not supported"):
        smap(lambda a: smap(lambda b: b)(a))(X)


def test_check_replicated() -> None:
    with pytest.raises(ShardingError, match=r"differ.*\['x'\] replicated"):
        smap(lambda a: a, out_specs=None, check_replicated=True)(X)
    out = smap(lambda a: lax.pmean(a, "x"), out_specs=None, check_replicated=True)(X)
    assert torch.allclose(out.to_torch(), X.reshape(4, 2, 3).mean(0))


def test_check_writes_false_still_reports_the_write_afterwards() -> None:
    caller = X.clone()
    with pytest.raises(ShardingError, match=r"modified argument 0's local block in place"):
        smap(lambda a: a.mul_(2), check_writes=False)(caller)
    assert torch.equal(caller, X * 2)  # the opt-out: stopped after the write, not before
