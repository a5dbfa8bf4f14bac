"""torch.compile of shardwise code (tests/api/test_compiling.py), on Gloo ranks and on
the simulated mesh: each body compiles with ``shardwise.compile_backend`` and checks
that Dynamo broke no graph, that three calls compile once, that values and gradients
equal eager shardwise's, and what the forward graph holds."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import shardwise as sw
from examples.gpt import GPT, Config, batch, parallelize, tp_plan
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
from shardwise.parallel import (
    ColwiseParallel,
    MixedPrecisionPolicy,
    RowwiseParallel,
    fully_shard,
    loss_parallel,
    parallelize_module,
)


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
        # (small, on CPU, over 3+ ranks: an all_gather and a local sum,
        # collectives.GATHER_REDUCE_MAX)
        one = "all_gather_into_tensor" if n > 2 else "all_reduce"
        assert forward.count(f"_c10d_functional.{one}") == 1, forward
        assert forward.count("_c10d_functional.all_") == 1, forward
        assert forward.count("_c10d_functional.wait_tensor") == 1, forward
    else:  # the simulated mesh: a relayout of whole values is local
        assert "_c10d_functional" not in forward, forward


def _steps(model: nn.Module, loss_of: Any, optimizer: Any) -> list[list[Any]]:
    """Three training steps of ``model`` on ``loss_of(step)``: per step the loss and the
    gradients, then the parameters after the last optimizer step."""
    opt = optimizer(model.parameters())
    out = []
    for step in range(3):
        loss = loss_of(step)
        loss.backward()
        out.append([loss.to_torch()] + [_value(p.grad) for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [*out, [_value(p) for p in model.parameters()]]


def _parallel_loss(forward: Any, inputs: Any) -> Any:
    """``loss_of`` for :func:`_steps`: ``forward(*inputs(step))`` under loss_parallel,
    summed where it is not a scalar."""

    def loss_of(step: int) -> Any:
        with loss_parallel():  # (only F.cross_entropy's handler changes)
            loss = forward(*inputs(step))
        return loss if loss.ndim == 0 else loss.sum()
    return loss_of


def _value(t: torch.Tensor) -> torch.Tensor:
    """The global value (a parameter that no plan names stays a plain tensor)."""
    return t.to_torch() if isinstance(t, sw.Tensor) else t.detach().clone()


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def _compiled_equals_eager(build: Any, inputs: Any, optimizer: Any, graphs: int = 1,
                           **close: float) -> None:
    """The model ``build()`` makes, compiled: no graph break, ``graphs`` graphs over three
    steps, losses, gradients and optimizer steps equal to eager shardwise's (``close``:
    assert_close's tolerances)."""
    eager = build()
    want = _steps(eager, _parallel_loss(eager, inputs), optimizer)
    model = build()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=sw.compile_backend("aot_eager"), dynamic=False)
    got = _steps(model, _parallel_loss(compiled, inputs), optimizer)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs, counters["stats"]  # no recompile
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **close)


class Head(nn.Module):
    """A classifier head and its loss (loss parallel over the class dim, under TP)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x), target)


def body_fsdp_and_loss_parallel(n: int) -> None:
    """fully_shard over n devices (an MLP, SGD; again computing in bf16), a Colwise head
    with loss parallel over n devices (AdamW), then the GPT example's plan (TP x FSDP,
    the head's loss parallel; AdamW) on a (n/2, 2) mesh ((1, 2) on 2 devices: its
    relayouts permute blocks)."""
    torch.manual_seed(0)
    base = MLP()
    mesh = DeviceMesh.cpu(n, "dp")
    x = sw.tensor(torch.randn(4 * n, 8), sharding=PlacementMapping(mesh, [Sharded(0)]))
    _compiled_equals_eager(lambda: fully_shard(_copy(base), mesh), lambda step: (x + step,),
                           lambda ps: torch.optim.SGD(ps, lr=0.1))
    # bf16 compute: the root unit's casts are a graph of their own (torch.compile runs
    # a module's hooks as frames beside its forward); on processes the compiled graph
    # sums the gradient's shares in bf16 where eager sums them in reduce_dtype: equal
    # within a few bf16 ulps
    # (and says so, once per unit, with a warning when the graph compiles)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _compiled_equals_eager(lambda: fully_shard(_copy(base), mesh, mp_policy=bf16),
                               lambda step: (x + step,),
                               lambda ps: torch.optim.SGD(ps, lr=0.1),
                               graphs=2, rtol=1 / 64, atol=1 / 16)
    said = [str(w.message) for w in seen if "sums the gradients' shares" in str(w.message)]
    if torch.distributed.is_initialized():
        # (two units were built, eager's and the compiled one's: both are still alive)
        assert len(said) == 2 and "not in reduce_dtype (torch.float32)" in said[0], said
    else:  # the simulated mesh reduces whole values: compiled equals eager exactly
        assert not said, said
    head, tp = Head(), DeviceMesh.cpu(n, "tp")
    y, target = torch.randn(6, 8), torch.randint(0, 16, (6,))
    _compiled_equals_eager(
        lambda: parallelize_module(_copy(head), tp, {
            "head": ColwiseParallel(output_layouts=Sharded(-1))}),
        lambda step: (y + step, target), _adamw)
    cfg = Config(seq=8, layers=1)
    gpt = GPT(cfg)
    mesh2 = DeviceMesh.cpu((max(n // 2, 1), 2), ("dp", "tp"))
    data = PlacementMapping(mesh2, (Sharded(0), Replicated()))

    def inputs(step: int) -> tuple[Any, ...]:
        return tuple(sw.tensor(t, sharding=data) for t in batch(cfg, 4, step))

    _compiled_equals_eager(lambda: parallelize(_copy(gpt), mesh2), inputs,
                           _adamw)


def _tiny_llama() -> Any:
    import transformers as T  # the `hf` test extra

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager"))


def _hf_loss(forward: Any, ids: Any) -> Any:
    """``loss_of`` for :func:`_steps`: HF's own loss (its labels padded by one
    position: a pad of the Sharded labels)."""
    return lambda step: forward(ids, labels=ids).loss


def body_hf_llama(n: int) -> None:
    """A tiny HF Llama under ``hf_plan``, trained on HF's loss, compiled: on a (n/2, 2)
    mesh with ``fully_shard`` per layer and root over dp (simulated, and on 4 ranks),
    on 2 ranks (kept cheap) TP over both; compiled whole, then per block (torchtitan).
    No graph break, one graph per compiled module over three steps, losses, gradients
    and AdamW steps equal to eager shardwise's."""
    from shardwise.parallel import hf_plan

    base = _tiny_llama()
    tp_only = torch.distributed.is_initialized() and n < 4
    mesh = DeviceMesh.cpu((1, n) if tp_only else (n // 2, 2), ("dp", "tp"))
    ids = sw.tensor(torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0)),
                    sharding=PlacementMapping(mesh, (Sharded(0), Replicated())))

    def build() -> Any:
        model = parallelize_module(_copy(base), mesh, hf_plan(base), axis="tp")
        if tp_only:
            return model
        for layer in model.model.layers:
            fully_shard(layer, mesh, axis="dp")
        return fully_shard(model, mesh, axis="dp")

    eager = build()
    want = _steps(eager, _hf_loss(eager, ids), _adamw)
    for blocks in (False, True):
        model = build()
        torch._dynamo.reset()
        counters.clear()
        if blocks:
            for layer in model.model.layers:
                layer.compile(backend=sw.compile_backend("aot_eager"), dynamic=False)
            forward = model
        else:
            forward = torch.compile(model, backend=sw.compile_backend("aot_eager"),
                                    dynamic=False)
        got = _steps(model, _hf_loss(forward, ids), _adamw)
        assert not counters["graph_break"], (blocks, dict(counters["graph_break"]))
        graphs = len(model.model.layers) if blocks else 1  # no recompile
        assert counters["stats"]["unique_graphs"] == graphs, (blocks, counters["stats"])
        # (on 4 ranks the graph's gradient exchanges sum in another order than eager's:
        # AdamW's normalized steps magnify the last bits)
        close = dict(rtol=1e-3, atol=1e-4) if torch.distributed.is_initialized() and not (
            tp_only) else {}
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **close)


def _cp_loss(forward: Any, cp: Any, data: Any) -> Any:
    """``loss_of`` for :func:`_steps`: examples/gpt.py's GPT called as ``forward`` inside
    the region ``cp`` (entered around the compiled call, as torchtitan does), the batch
    through ``cp.shard``."""
    cfg = Config(seq=8, layers=1)

    def loss_of(step: int) -> Any:
        ids, targets = batch(cfg, 2, step)
        with cp, loss_parallel():
            positions = (torch.arange(cfg.seq) if cp.method == "ring"
                         else cp.shard(torch.arange(cfg.seq), 0))
            return forward(cp.shard(ids, 1, data), cp.shard(targets, 1, data), positions)
    return loss_of


def body_context_parallel(n: int) -> None:
    """examples/gpt.py's GPT with context parallel, ring and all-to-all (Ulysses),
    compiled whole and per block: on a simulated cp x tp = 2x2 mesh with the TP plan,
    on processes cp over the n ranks. No graph break, one graph per compiled module
    over three steps, losses, gradients and AdamW steps equal to eager shardwise's."""
    from shardwise.parallel import context_parallel

    processes = torch.distributed.is_initialized()
    mesh = DeviceMesh.cpu(n, "cp") if processes else DeviceMesh.cpu((2, 2), ("cp", "tp"))
    data = PlacementMapping(mesh, tuple(Replicated() for _ in mesh.axis_names))
    torch.manual_seed(0)
    base = GPT(Config(seq=8, layers=1))

    def build() -> Any:
        model = _copy(base)
        if not processes:
            parallelize_module(model, mesh, tp_plan(), axis="tp")
        return model

    for method, blocks in (("ring", False), ("alltoall", False), ("ring", True)):
        cp = context_parallel(mesh, "cp", method=method)
        eager = build()
        want = _steps(eager, _cp_loss(eager, cp, data), _adamw)
        model = build()
        torch._dynamo.reset()
        counters.clear()
        if blocks:  # torchtitan: each block compiled
            for layer in model.layers:
                layer.compile(backend=sw.compile_backend("aot_eager"), dynamic=False)
            forward = model
        else:
            forward = torch.compile(model, backend=sw.compile_backend("aot_eager"),
                                    dynamic=False)
        got = _steps(model, _cp_loss(forward, cp, data), _adamw)
        assert not counters["graph_break"], (method, dict(counters["graph_break"]))
        assert counters["stats"]["unique_graphs"] == 1, (method, counters["stats"])
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)


def body_expert_parallel(n: int) -> None:
    """examples/moe_gpt.py's MoE GPT, dp2ep x TP x fully_shard, with a capacity factor
    (fixed slots: static exchanges), compiled: on a simulated dp x tp = 2x2 mesh, on
    processes (n, 1). No graph break, values, gradients and AdamW steps equal to eager
    shardwise's; two graphs over three steps: the model's ``tokens_per_expert`` buffer
    is a plain tensor on the first call and a shardwise Tensor after it (its own
    update), one recompile for the new type, none after. Dropless is a listed break."""
    import importlib.util
    import sys

    name = "shardwise_example_moe_gpt"
    moe = sys.modules.get(name)
    if moe is None:
        spec = importlib.util.spec_from_file_location(name, "examples/moe_gpt.py")
        assert spec is not None and spec.loader is not None
        moe = importlib.util.module_from_spec(spec)
        sys.modules[name] = moe
        spec.loader.exec_module(moe)
    processes = torch.distributed.is_initialized()
    mesh = DeviceMesh.cpu((n, 1) if processes else (2, 2), ("dp", "tp"))
    cfg = moe.Config(seq=8, layers=1)
    torch.manual_seed(0)
    base = moe.MoEGPT(cfg)
    data = PlacementMapping(mesh, (Sharded(0), Replicated()))

    def inputs(step: int) -> tuple[Any, ...]:
        return tuple(sw.tensor(t, sharding=data) for t in moe.gpt.batch(cfg, 4, step))

    # (on processes the graph's gradient exchanges sum in another order: AdamW's
    # steps then differ by ~1e-5 on a few elements)
    close = dict(rtol=1e-3, atol=1e-4) if processes else {}
    _compiled_equals_eager(lambda: moe.parallelize(_copy(base), mesh, capacity_factor=4.0),
                           inputs, _adamw, graphs=2, **close)

    from shardwise.debug import GraphBreakCounter

    model = moe.parallelize(_copy(base), mesh)  # dropless: the counts read on the host
    torch._dynamo.reset()
    with GraphBreakCounter() as gb, loss_parallel():
        torch.compile(model, backend=sw.compile_backend("aot_eager"), dynamic=False)(
            *inputs(0))
    assert gb.total and all(e.in_shardwise for e in gb.events), gb
    assert any("capacity_factor" in cause for cause in gb.counts), gb  # the fix, named


def _copy(m: nn.Module) -> Any:
    import copy

    return copy.deepcopy(m)


def _lengths(forward: Any, run: Any, lengths: tuple[int, ...], dynamic: bool | None) -> int:
    """``run(f, t)`` (a list of values) for each sequence length ``t``, with ``f`` the
    eager ``forward`` and compiled (``dynamic``): values equal, no graph break.
    Returns the number of graphs Dynamo compiled."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(forward, backend=sw.compile_backend("aot_eager"), dynamic=dynamic)
    for t in lengths:
        for got, want in zip(run(compiled, t), run(forward, t), strict=True):
            torch.testing.assert_close(got, want)
    assert not counters["graph_break"], dict(counters["graph_break"])
    return int(counters["stats"]["unique_graphs"])


def body_dynamic_sequence(n: int) -> None:
    """A changing sequence length under dynamic shapes: the GPT example with Megatron
    TP (its batch Sharded) compiles once with ``dynamic=True`` over 4 lengths, the
    Megatron MLP (batch replicated) twice with Dynamo's default (static first,
    dynamic after the first new length); a program on a sequence sharded over the
    mesh keeps one graph while the mesh divides the length and specialises one that
    it does not (9 over 2)."""
    torch.manual_seed(0)
    cfg = Config(seq=24, layers=1)
    mesh = DeviceMesh.cpu(n, "tp")
    gpt = parallelize(GPT(cfg), mesh, fsdp=False)
    rows = PlacementMapping(mesh, [Sharded(0)])

    def step(f: Any, t: int) -> list[Any]:
        g = torch.Generator().manual_seed(t)
        ids = torch.randint(0, cfg.vocab, (4, t + 1), generator=g)
        with loss_parallel():  # (the batch Sharded: gathered and cut along batch x sequence)
            loss = f(sw.tensor(ids[:, :-1].contiguous(), sharding=rows),
                     sw.tensor(ids[:, 1:].contiguous(), sharding=rows))
        loss.backward()
        grads = [p.grad for p in gpt.parameters()]
        gpt.zero_grad(set_to_none=True)
        return [v.to_torch() if isinstance(v, sw.Tensor) else v for v in [loss, *grads]]

    assert _lengths(gpt, step, (8, 12, 16, 24), True) == 1
    mlp = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def mlp_step(f: Any, t: int) -> list[Any]:
        y = f(torch.randn(4, t, 8, generator=torch.Generator().manual_seed(t)))
        y.sum().backward()
        grads = [p.grad.to_torch() for p in mlp.parameters()]
        mlp.zero_grad(set_to_none=True)
        return [y.to_torch(), *grads]

    assert _lengths(mlp, mlp_step, (8, 12, 16, 24), None) == 2
    # sizes no two of which Dynamo's duck sizing could take for one (batch 3, blocks of
    # t/2, width 5): it would guard on their equality
    w = sw.tensor(torch.randn(5, 5), sharding=PlacementMapping(mesh, [Replicated()]))
    w.requires_grad_()

    def forward(x: Any, w: Any) -> Any:
        h = F.linear(x, w).relu()
        return h.sum(-1), h.sum()

    def program(f: Any, t: int) -> list[Any]:
        x = sw.tensor(torch.randn(3, t, 5, generator=torch.Generator().manual_seed(t)),
                      sharding=PlacementMapping(mesh, [Sharded(1)]))
        rows, total = f(x, w)
        total.backward()
        g, w.grad = w.grad.to_torch(), None
        return [rows.to_torch(), total.to_torch(), g]

    assert _lengths(forward, program, (8, 12, 16, 9), True) == 2  # (9: its own graph)


BODIES = ["body_tiny_program", "body_megatron_mlp", "body_fsdp_and_loss_parallel",
          "body_hf_llama", "body_dynamic_sequence", "body_context_parallel",
          "body_expert_parallel"]
