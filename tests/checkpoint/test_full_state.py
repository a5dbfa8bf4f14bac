"""``full_state_dict`` / ``gather_values``: plain tensors of the global values, tied
weights as one tensor (state_dict() detaches each tied name into its own wrapper),
never two different values merged (equal values in distinct storages, empty blocks
whose addresses coincide, a Partial value)."""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise import Partial, PlacementMapping, Sharded
from shardwise.checkpoint.state import gather_values
from tests.helpers.meshes import M2, M22


def test_tied_weights_are_one_tensor_and_equal_torch() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head
    want = {k: v.clone() for k, v in model.state_dict().items()}
    model[0].weight = torch.nn.Parameter(sw.tensor(
        model[0].weight.detach(), sharding=PlacementMapping(M22, [Sharded(0), Sharded(1)])))
    model[1].weight = model[0].weight
    got = sw.checkpoint.full_state_dict(model)
    assert got["0.weight"] is got["1.weight"]
    assert type(got["0.weight"]) is torch.Tensor
    assert torch.equal(got["0.weight"], want["0.weight"])


def test_distinct_values_are_never_merged() -> None:
    rows = PlacementMapping(M2, [Sharded(0)])
    a, b = torch.ones(4, 2), torch.ones(4, 2)  # equal values, distinct storages
    c, d = torch.arange(3.).reshape(1, 3), torch.arange(3., 6.).reshape(1, 3)  # device 1: empty
    state = {"a": sw.tensor(a, sharding=rows), "b": sw.tensor(b, sharding=rows),
             "c": sw.tensor(c, sharding=rows), "d": sw.tensor(d, sharding=rows),
             "p": sw.from_local([c * 0.5, c * 0.5], PlacementMapping(M2, [Partial()])),
             "q": sw.from_local([d, d * 0], PlacementMapping(M2, [Partial()])), "n": 7}
    out = gather_values(state)
    assert out["a"] is not out["b"] and out["n"] == 7
    for name, want in (("a", a), ("b", b), ("c", c), ("d", d), ("p", c), ("q", d)):
        assert type(out[name]) is torch.Tensor and torch.equal(out[name], want), name
