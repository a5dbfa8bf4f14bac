"""torch.compile of shardwise code (tests/api/test_compiling.py), on Gloo ranks and on
the simulated mesh: each body compiles with ``shardwise.compile_backend`` and checks
that Dynamo broke no graph, that three calls compile once, that values and gradients
equal eager shardwise's, and what the forward graph holds."""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo
import torch.nn as nn
from torch._dynamo.utils import counters

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Graphs:
    """An inner compiler that keeps the graphs AOTAutograd hands it (forward, backward)."""

    def __init__(self) -> None:
        self.code: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.code.append(gm.code)
        return gm


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def compiled_steps(forward: Any, train: Any, graphs: Graphs) -> list[Any]:
    """``train(forward)`` three times with ``forward`` compiled (the backward runs
    outside it, as in a training loop): no graph break, one compiled frame."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(forward, backend=sw.compile_backend(graphs), dynamic=False)
    got = [train(compiled) for _ in range(3)]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["frames"]["total"] == 1, counters["frames"]  # no recompile
    return got


def body_tiny_program(n: int) -> None:
    mesh = DeviceMesh.cpu(n, "x")
    torch.manual_seed(0)
    x = sw.tensor(torch.randn(4, 8), sharding=PlacementMapping(mesh, [Sharded(0)]))
    w = sw.tensor(torch.randn(6, 8), sharding=PlacementMapping(mesh, [Replicated()]))
    w.requires_grad_()

    def forward(x: Any, w: Any) -> Any:
        return torch.nn.functional.linear(x, w).relu().sum()

    def train(f: Any) -> list[torch.Tensor]:
        y = f(x, w)
        y.backward()
        g, w.grad = w.grad.to_torch(), None
        return [y.to_torch(), g]

    graphs = Graphs()  # compiled first: the trace meets the gradient's group first
    compiled = compiled_steps(forward, train, graphs)
    want = train(forward)
    for got in compiled:
        torch.testing.assert_close(got, want)
    assert len(graphs.code) == 2  # one forward, one backward


def body_megatron_mlp(n: int) -> None:
    mesh = DeviceMesh.cpu(n, "tp")
    torch.manual_seed(0)
    model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(),
                                             "down": RowwiseParallel()})
    x = torch.randn(4, 8)

    def train(m: Any) -> list[torch.Tensor]:
        y = m(x)
        y.sum().backward()
        grads = [p.grad.to_torch() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return [y.to_torch(), *grads]

    want = train(model)
    graphs = Graphs()
    for got in compiled_steps(model, train, graphs):
        torch.testing.assert_close(got, want)
    forward = graphs.code[0]
    if torch.distributed.is_initialized():  # the rowwise output's all_reduce, in the graph
        assert forward.count("_c10d_functional.all_reduce") == 1, forward
        assert forward.count("_c10d_functional.wait_tensor") == 1, forward
    else:  # the simulated mesh: a relayout of whole values is local
        assert "_c10d_functional" not in forward, forward


BODIES = ["body_tiny_program", "body_megatron_mlp"]
