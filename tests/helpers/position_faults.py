"""Bodies for program-position faults (issue 24, item 5): a rank that lays one layer
out row-wise where the others lay it out column-wise issues an all_reduce with the same
op, shape, dtype and layout as theirs, from another module; it must be stopped at its
first tensor-parallel collective, before any data is exchanged, on every rank.

``SHARDWISE_TEST_REPORT`` (a folder): each rank writes its error and timing there
(the fault table of the issue's closing note)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.nn as nn

import shardwise as sw
from shardwise import DeviceMesh, Partial, PlacementMapping
from shardwise.distributed import CollectiveError, process_index
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.runtime import position
from shardwise.runtime.process import channel

TIMEOUT_S = 3.0


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, d: int, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def plan(rowwise_first: bool, depth: int = 2) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(depth):
        out[f"layers.{i}.mlp.fc1"] = ColwiseParallel()
        out[f"layers.{i}.mlp.fc2"] = RowwiseParallel()
    if rowwise_first:
        out["layers.0.mlp.fc1"] = RowwiseParallel()
    return out


class Agreed:
    """Counts the collectives every member agreed to (their data then moved)."""

    def __init__(self) -> None:
        self.count = 0
        self._orig = channel.Channel.agreed
        counter = self

        def agreed(ch: Any, fp: Any) -> None:
            counter.count += 1
            counter._orig(ch, fp)

        channel.Channel.agreed = agreed  # type: ignore[method-assign]

    def close(self) -> None:
        channel.Channel.agreed = self._orig  # type: ignore[method-assign]


def _report(name: str, **fields: Any) -> None:
    folder = os.environ.get("SHARDWISE_TEST_REPORT")
    if folder:
        with open(os.path.join(folder, f"{name}.{process_index()}.json"), "w") as f:
            json.dump(fields, f)


def body_mispaired_styles(n: int) -> None:
    """Rank 1 lays layers.0.mlp.fc1 out row-wise, the others column-wise; the tp group
    exists already (a warm-up all_reduce), so the first divergent collective is the
    first all_reduce of the forward: the same op, shape, dtype and layout on every
    rank, issued by fc1's output on rank 1 and by fc2's on the others."""
    _mispaired(n, warm=True)


def body_mispaired_styles_cold(n: int) -> None:
    """As above, but the first op that needs the tp group creates it (a collective
    over the world): that is the first divergent collective, inside fc1's linear on
    rank 1 (row-wise: a Partial output) and inside fc2's on the others (column-wise fc1
    needs no collective in forward, and its input records no gradient)."""
    _mispaired(n, warm=False)


def _mispaired(n: int, warm: bool) -> None:
    d = 4 * n
    torch.manual_seed(0)
    model = Net(d)
    me = process_index()
    mesh = DeviceMesh.cpu((n,), ("tp",))
    parallelize_module(model, mesh, plan(me == 1))
    x = torch.randn(4, d)
    if warm:
        sw.all_reduce(sw.tensor(torch.ones(2), sharding=PlacementMapping(mesh, [Partial()])))
    counter = Agreed()
    start = time.monotonic()
    try:
        for _ in range(2):
            model(x).sum().backward()
    except CollectiveError as err:
        text, took = str(err), time.monotonic() - start
    else:
        raise AssertionError("the mis-paired program ran two steps without an error")
    finally:
        counter.close()
    _report(f"mispaired_styles{'' if warm else '_cold'}", error=text, seconds=took,
            agreed=counter.count)
    if os.environ.get("SHARDWISE_TEST_BEFORE"):
        return  # measuring main: no expectations
    assert counter.count == 0, f"{counter.count} collectives exchanged data first: {text}"
    if warm:
        fc1 = "all_reduce at layers.0.mlp.fc1 (RowwiseParallel linear) in output"
        fc2 = "all_reduce at layers.0.mlp.fc2 (RowwiseParallel linear) in output"
    else:
        fc1 = "create process groups at layers.0.mlp.fc1 (RowwiseParallel linear) in linear"
        fc2 = "create process groups at layers.0.mlp.fc2 (RowwiseParallel linear) in linear"
    others = ", ".join(str(r) for r in range(n) if r != 1)
    if me == 1:
        assert f"rank 1 issued {fc1}, where ranks {others} issued {fc2}" in text, text
    else:
        assert f"ranks {others} issued {fc2}, where rank 1 issued {fc1}" in text, text
    assert "Nothing was exchanged" in text, text
    assert took < TIMEOUT_S + 6, f"the error came after {took:.1f} s: {text}"


def body_same_program_agrees(n: int) -> None:
    """The same plan on every rank: positions agree, forward and backward (two steps),
    and the values equal the single-device model's."""
    d = 4 * n
    torch.manual_seed(0)
    ref = Net(d)
    torch.manual_seed(0)
    model = Net(d)
    mesh = DeviceMesh.cpu((n,), ("tp",))
    parallelize_module(model, mesh, plan(False))
    x = torch.randn(4, d)
    seen: list[str] = []
    orig = channel.Channel.agreed

    def agreed(ch: Any, fp: Any) -> None:  # where each agreed collective was issued
        seen.append(f"{fp.what} at {position.text()}")
        orig(ch, fp)

    channel.Channel.agreed = agreed  # type: ignore[method-assign]
    try:
        for _ in range(2):
            out = model(x)
            out.sum().backward()
            want = ref(x)
            want.sum().backward()
    finally:
        channel.Channel.agreed = orig  # type: ignore[method-assign]
    # forward: each fc2's output all_reduce; backward: the all_reduce of layers.1.mlp.fc1's
    # input gradient (layers.0's input is the plain x: no gradient, no collective)
    step = ["all_reduce at layers.0.mlp.fc2 (RowwiseParallel linear) in output",
            "all_reduce at layers.1.mlp.fc2 (RowwiseParallel linear) in output",
            "all_reduce at backward of layers.1.mlp.fc1 (ColwiseParallel linear) in linear"]
    # the tp group is created where the first collective needs it: fc2's linear (fc1's
    # input diverge records nothing, so it is skipped and needs no group)
    assert seen == ["create process groups at layers.0.mlp.fc2 (RowwiseParallel linear) in "
                    "linear", *step, *step], seen
    assert torch.equal(out.to_torch(), want) or torch.allclose(out.to_torch(), want, atol=1e-6)
    got = model.layers[0].mlp.fc1.weight.grad.to_torch()  # type: ignore[union-attr,operator]
    assert torch.allclose(got, ref.layers[0].mlp.fc1.weight.grad, atol=1e-6)  # type: ignore[union-attr,index,arg-type]
