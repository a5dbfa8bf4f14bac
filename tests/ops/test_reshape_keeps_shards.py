"""reshape keeps a split or merged dim sharded on its run's first dim when every block
stays contiguous (attention's view into heads), and gathers otherwise."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import PlacementMapping, Replicated, Sharded
from shardwise.debug import CommCounter
from shardwise.sharding.shapes import reshape_dims
from tests.helpers.meshes import M24 as MESH

DP, TP = 0, 1


@pytest.mark.parametrize("src,new,dims,want", [
    ((2, 32), (2, 4, 8), ((), (TP,)), ((), (TP,), ())),          # split: heads sharded
    ((2, 4, 8), (2, 32), ((), (TP,), ()), ((), (TP,))),          # merge back
    ((8, 16, 32), (128, 32), ((DP,), (), (TP,)), ((DP,), (TP,))),  # flatten(0, 1)
    ((2, 32), (2, 2, 16), ((), (TP,)), None),                    # 2 heads over 4 devices
    ((2, 4, 8), (2, 32), ((), (), (TP,)), None),                 # the minor dim sharded
    ((8, 16), (128,), ((DP,), (TP,)), None),                     # both dims of a run
    ((8, 1, 6), (8, 6), ((DP,), (), (TP,)), ((DP,), (TP,))),      # a size-1 dim dropped
    ((1, 8), (8,), ((TP,), ()), None),                           # a sharded size-1 dim
    ((16, 6), (8, 2, 6), ((DP, TP), ()), ((DP, TP), (), ())),    # over two mesh axes
    ((0, 4), (4, 0), ((), ()), ((), ())),
])
def test_reshape_dims(src: tuple[int, ...], new: tuple[int, ...],
                      dims: tuple[tuple[int, ...], ...], want: object) -> None:
    assert reshape_dims(src, new, dims, (2, 4)) == want


@pytest.mark.parametrize("placements,shape,new,comm", [
    ([Sharded(0), Sharded(2)], (2, 16, 32), (2, 16, 4, 8), False),
    ([Sharded(0), Sharded(2)], (2, 16, 32), (2, 16, 2, 16), True),  # 2 heads, 4 devices
    ([Sharded(0), Sharded(1)], (4, 8, 6), (32, 6), True),           # dp's and tp's dims
    ([Sharded(0), Sharded(2)], (4, 8, 12), (32, 12), False),
    ([Replicated(), Sharded(0)], (8, 6), (4, 2, 6), False),
    ([Replicated(), Sharded(0)], (8, 6), (2, 4, 6), True),          # 2 rows, 4 devices
    ([Sharded(1), Replicated()], (3, 4, 5), (3, 2, 10), False),     # uneven elsewhere
])
def test_values_gradients_and_communication(placements: list[object],
                                            shape: tuple[int, ...], new: tuple[int, ...],
                                            comm: bool) -> None:
    value = torch.randn(shape, dtype=torch.float64)
    x = sw.tensor(value, sharding=PlacementMapping(MESH, placements)).requires_grad_()
    with CommCounter() as cc:
        y = x.reshape(new)
    assert (cc.total > 0) == comm
    torch.testing.assert_close(y.detach().to_torch(), value.reshape(new))
    w = torch.randn(new, dtype=torch.float64)
    (y * w).sum().backward()
    assert x.grad.dist_layout == x.dist_layout
    torch.testing.assert_close(x.grad.to_torch(), w.reshape(shape))
    back = y.reshape(shape)
    torch.testing.assert_close(back.detach().to_torch(), value)
