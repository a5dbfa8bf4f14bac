"""torch.compile through shardwise (issue 37): Dynamo records shardwise Tensors' ops and
a parallelized module's hooks as one graph (tensor parallel, fully_shard, loss
parallel, pipeline stages), ``shardwise.compile_backend`` lowers it to local ops and functional
collectives, and graph breaks of shardwise programs are listed and raise in strict mode;
dynamic shapes keep one graph over sequence lengths (``body_dynamic_sequence``).

Kept cheap: tiny programs, the ``aot_eager`` inner compiler (graph breaks, guards and
the traced graphs are the same whatever compiles them), one Gloo launch of 2 ranks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.exc import TorchDynamoException
from torch._dynamo.utils import counters

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded, ShardingError
from shardwise.parallel import parallelize_module
from tests.helpers import compile_bodies
from tests.helpers.harness import check_body


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", compile_bodies.BODIES)
def test_compile_body_on_gloo(name: str) -> None:
    check_body(compile_bodies.__name__, compile_bodies.BODIES, 2, name)


#: on 4 Gloo ranks too: the small all_reduce as an all_gather (3+ ranks), and the HF
#: Llama's hf_plan x fully_shard on a (2, 2) process mesh
ON_FOUR = ("body_megatron_mlp", "body_hf_llama")


@pytest.mark.parametrize("name", ON_FOUR)
def test_compile_body_on_four_gloo_ranks(name: str) -> None:
    check_body(compile_bodies.__name__, ON_FOUR, 4, name)


@pytest.mark.parametrize("name", compile_bodies.BODIES)
def test_compile_body_simulated(name: str) -> None:
    getattr(compile_bodies, name)(4 if name in FOUR else 2)


#: the bodies run on a simulated 2x2 (dp, tp) mesh here (2 ranks on Gloo)
FOUR = ("body_fsdp_and_loss_parallel", "body_hf_llama", "body_context_parallel",
        "body_expert_parallel")


def _operands() -> tuple[sw.Tensor, sw.Tensor]:
    mesh = DeviceMesh.cpu(2, "x")
    x = sw.tensor(torch.randn(4, 8), sharding=PlacementMapping(mesh, [Sharded(0)]))
    w = sw.tensor(torch.randn(6, 8), sharding=PlacementMapping(mesh, [Replicated()]))
    return x, w.requires_grad_()


def _linear_sum(x: Any, w: Any) -> Any:
    return torch.nn.functional.linear(x, w).sum()


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_torch_compile_with_torchs_own_backends_trains(backend: str) -> None:
    """``torch.compile(f)`` (inductor, the default) and ``backend="aot_eager"`` compile
    a graph of shardwise Tensors as ``compile_backend`` does: values and gradients equal
    eager, one graph, no break; a graph of plain tensors still goes to torch's backend
    (its compiled code is torch's own)."""
    x, w = _operands()
    want = _linear_sum(x, w)
    want.backward()
    grad, w.grad = w.grad.to_torch(), None
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(_linear_sum, backend=backend, dynamic=False)
    for _ in range(3):
        got = f(x, w)
        got.backward()
        torch.testing.assert_close(got.to_torch(), want.to_torch())
        torch.testing.assert_close(w.grad.to_torch(), grad)
        w.grad = None
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    plain = torch.compile(lambda a: (a * 2).sum(), backend=backend, dynamic=False)
    assert plain(torch.ones(3)).item() == 6.0


def test_other_aot_backends_refuse_to_differentiate_and_name_the_fix() -> None:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    x, w = _operands()
    own = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm))  # a user's own backend
    f = torch.compile(_linear_sum, backend=own, dynamic=False)
    with pytest.raises(TorchDynamoException, match=re.escape("backend=shardwise.compile_backend")):
        f(x, w)
    with torch.no_grad():  # nothing to differentiate: torch's own AOTAutograd is enough
        torch.testing.assert_close(f(x, w).to_torch(), (x.to_torch() @ w.to_torch().T).sum())


def test_an_op_without_a_rule_is_refused_under_compile() -> None:
    x, _ = _operands()
    f = torch.compile(lambda x: torch.nonzero(x), backend=sw.compile_backend("aot_eager"),
                      dynamic=False)
    with pytest.raises(TorchDynamoException, match="no sharding rule, and under torch"):
        f(x)


def test_unknown_inner_compiler_is_named() -> None:
    with pytest.raises(ShardingError, match="'inductor', 'aot_eager'"):
        sw.compile_backend("tvm")


def _breaking(x: sw.Tensor) -> sw.Tensor:
    y = x.relu()
    if y.sum().item() > 0:  # a data-dependent branch: Dynamo breaks the graph here
        return y * 2
    return y


def test_graph_breaks_are_listed_and_strict_mode_raises_naming_them() -> None:
    from shardwise.debug import GraphBreakCounter

    x, _ = _operands()
    rep = PlacementMapping(x.mesh, [Replicated()])
    f = torch.compile(_breaking, backend=sw.compile_backend("aot_eager"), dynamic=False)
    with GraphBreakCounter() as gb, torch.no_grad():
        torch.testing.assert_close(f(x).to_torch(), _breaking(x).to_torch())
    assert gb.total == 1 and "Tensor.item()" in next(iter(gb.counts)), gb
    assert not gb.events[0].in_shardwise
    torch._dynamo.reset()
    with sw.strict(), torch.no_grad(), pytest.raises(
            ShardingError, match=r"broke the graph on a shardwise Tensor .*Tensor\.item\(\)"):
        f(x)

    def placing(x: sw.Tensor) -> sw.Tensor:  # shardwise's placing functions run eagerly
        return x + sw.tensor(torch.ones(4, 8), sharding=rep)

    g = torch.compile(placing, backend=sw.compile_backend("aot_eager"), dynamic=False)
    with sw.strict(), torch.no_grad(), pytest.raises(
            ShardingError, match=r"in shardwise's code .*\(tensor\)"):
        g(x)
    with torch.no_grad():  # out of strict mode, the graph runs (uncompiled)
        torch.testing.assert_close(g(x).to_torch(), placing(x).to_torch())

    def placing_again(x: sw.Tensor) -> sw.Tensor:  # (a frame not compiled yet)
        return x + sw.tensor(torch.ones(4, 8), sharding=rep)

    with GraphBreakCounter() as gb, torch.no_grad():
        torch.compile(placing_again, backend=sw.compile_backend("aot_eager"), dynamic=False)(x)
    assert gb.counts["Attempted to call function marked as skipped (tensor)"] == 1, gb
    assert all(e.in_shardwise for e in gb.events)

    torch._dynamo.reset()  # torch's own backend: the next compile (the resumed frame) raises
    h = torch.compile(_breaking, backend="eager", dynamic=False)
    with sw.strict(), torch.no_grad(), pytest.raises(ShardingError, match=r"Tensor\.item\(\)"):
        h(x)

    def plain(t: torch.Tensor) -> torch.Tensor:  # not shardwise's: neither listed nor raised
        return t * 2 if t.sum().item() > 0 else t

    with sw.strict(), GraphBreakCounter() as gb:
        torch.compile(plain, backend="eager")(torch.ones(2))
    assert gb.total == 0


def test_pipeline_stages_compile() -> None:
    """pp=2 x tp=2, 1F1B over 2 microbatches, each stage's module compiled in place
    (``nn.Module.compile``): no graph break, one graph per stage over 2 steps (4 calls of
    each stage), losses and gradients equal to the eager pipeline's."""
    import copy

    from shardwise.debug import GraphBreakCounter
    from shardwise.pipelining import Schedule1F1B, pipeline
    from tests.helpers import pp_models as pm

    ref, (x, t) = pm.make(2), pm.batch(pm.config(2), 2)

    def steps(compiled: bool) -> list[Any]:
        pipe = pipeline(copy.deepcopy(ref), DeviceMesh.cpu((2, 2), ("pp", "tp")),
                        split_points=["layers.1"])
        for st in pipe.stages:
            parallelize_module(st.module, st.mesh, pm.plan_for(st.module))
            if compiled:
                st.module.compile(backend=sw.compile_backend("aot_eager"), dynamic=False)
        out: list[Any] = []
        for _ in range(2):
            losses: list[Any] = []
            Schedule1F1B(pipe, n_microbatches=2, loss_fn=pm.loss_fn).step(x, target=t,
                                                                          losses=losses)
            out += [pm.values(v) for v in losses]
            out += [pm.values(p.grad) for st in pipe.stages for p in st.module.parameters()]
            for st in pipe.stages:
                st.module.zero_grad(set_to_none=True)
        return out

    want = steps(False)
    counters.clear()
    with GraphBreakCounter() as gb:
        got = steps(True)
    assert gb.total == 0 and not counters["graph_break"], gb
    assert counters["stats"]["unique_graphs"] == 2, counters["stats"]  # one per stage
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_per_block_compile_with_torchs_backend_trains() -> None:
    """torchtitan's per-block compile with torch's own backend (``layer.compile()``)
    on the GPT example's TP x FSDP plan: losses and AdamW steps equal eager shardwise's,
    no graph break."""
    import copy

    from examples.gpt import GPT, Config, batch, parallelize
    from shardwise.parallel import loss_parallel

    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    cfg = Config(layers=2)
    torch.manual_seed(0)
    base = GPT(cfg)
    data = PlacementMapping(mesh, (Sharded(0), Replicated()))

    frames: list[int] = []

    def train(compiled: bool) -> list[float]:
        model = parallelize(copy.deepcopy(base), mesh)
        if compiled:
            for layer in model.layers:
                layer.compile(backend="aot_eager", dynamic=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            frames.append(counters["frames"]["total"])
            ids, targets = batch(cfg, 8, step)
            with loss_parallel():
                loss = model(sw.tensor(ids, sharding=data), sw.tensor(targets, sharding=data))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.to_torch().item())
        return losses

    want = train(False)
    torch._dynamo.reset()
    counters.clear()
    frames.clear()
    got = train(True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # compiled in the first step (the blocks share their code: Dynamo guards each
    # block's modules, so each has its graph), then never again
    assert frames[0] == 0 and frames[1] == frames[2] == counters["frames"]["total"] > 0, (
        frames, counters["frames"])
    torch.testing.assert_close(got, want)
