"""lax.ragged_all_to_all's errors (its values, gradients and bytes: ``shardmap_bodies``,
on both runtimes), shard_map's
out_shapes (no exchange of block shapes), and the bytes CommCounter counts for lax
collectives (what each device sends to the others, as the planner counts its steps)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import ShardingError, lax
from shardwise.debug import CommCounter
from shardwise.sharding.errors import ShardingTypeError
from tests.helpers.meshes import M4 as MESH


def smap(fn: Any, x: torch.Tensor, **kw: Any) -> Any:
    return sw.shard_map(fn, MESH, in_specs=(("x", None),), out_specs=("x", None), **kw)(x)


def test_ragged_errors_name_the_fix() -> None:
    x = torch.ones(8, 2)
    with pytest.raises(ShardingError, match=r"4x4 matrix of non-negative Python ints"):
        smap(lambda a: lax.ragged_all_to_all(a, "x", [[2, 0, 0, 0]]), x)
    with pytest.raises(ShardingError, match=r"4x4 matrix"):
        smap(lambda a: lax.ragged_all_to_all(a, "x", [[2, 0, 0, -0.5]] * 4), x)
    with pytest.raises(ShardingError, match=r"sends 3 entries .* but its x has 2 along axis 0"):
        smap(lambda a: lax.ragged_all_to_all(a, "x", [[1, 1, 1, 0]] * 4), x)
    with pytest.raises(ShardingError, match=r"outside shard_map"):
        lax.ragged_all_to_all(x, "x", [[8]])


def test_out_shapes_checked_and_used() -> None:
    x = torch.arange(10.0).reshape(5, 2)
    y = smap(lambda a: a * 2, x, out_shapes=(5, 2))
    assert torch.equal(y.to_torch(), x * 2)
    with pytest.raises(ShardingError, match=r"out_shapes gives global shape \(6, 2\)"):
        smap(lambda a: a, x, out_shapes=(6, 2))
    two = sw.shard_map(lambda a: (a, a), MESH, in_specs=(("x", None),),
                       out_specs=(("x", None), ("x", None)), out_shapes=(5, 2))
    with pytest.raises(ShardingTypeError, match=r"one global shape per output"):
        two(x)


def test_lax_bytes_are_what_each_device_sends() -> None:
    block = 2 * 3 * 4  # a (2, 3) float32 block per device, 4 devices

    def fn(a: torch.Tensor) -> torch.Tensor:
        lax.psum(a, "x")
        lax.all_gather(a, "x", tiled=True)
        lax.psum_scatter(torch.cat([a, a]), "x")
        lax.all_to_all(torch.cat([a, a]), "x", 0, 0)
        lax.ppermute(a, "x", [(0, 1), (1, 0)])
        return a

    with CommCounter() as cc:
        smap(fn, torch.ones(8, 3))
    assert cc.bytes == {"all_reduce": 2 * block * 3 // 4, "all_gather": block * 3,
                        "reduce_scatter": 2 * block * 3 // 4,
                        "all_to_all": 2 * block * 3 // 4, "ppermute": block}


def test_shard_maps_default_wait_is_initializes() -> None:
    from shardwise.api import distributed
    from shardwise.runtime import spmd

    assert spmd.DEFAULT_TIMEOUT_S == distributed.DEFAULT_TIMEOUT_S
