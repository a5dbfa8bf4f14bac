"""The runtime floor's two backends: one protocol, collectives written once.

Invariants checked here (docs/DESIGN.md §1, §6):
- both backends provide every method of the Backend protocol (shard_map's SPMD ones too);
- the in-process collectives give the reference values (exact mode: bit for bit in
  member order) and split MAX/MIN ties evenly in the gradient (as the process
  backend's transpose does);
- the process backend's specs form one family run by one autograd Function.
"""

from __future__ import annotations

import inspect

import torch

from shardwise.runtime import Backend, collectives
from shardwise.runtime import process as process_pkg
from shardwise.runtime import simulated as simulated_pkg
from shardwise.runtime.process import backend as process
from shardwise.runtime.process import functions
from shardwise.runtime.simulated import backend as simulated
from shardwise.sharding import ReduceOp


def _protocol_methods() -> set[str]:
    return {n for n, v in vars(Backend).items() if inspect.isfunction(v) and not n.startswith("_")}


def test_both_backends_implement_the_whole_protocol() -> None:
    methods = _protocol_methods()
    assert {"run_spmd", "spmd_outputs", "execute_plan", "assemble"} <= methods
    for mod in (simulated, process, simulated_pkg, process_pkg):
        missing = sorted(m for m in methods if not callable(getattr(mod, m, None)))
        assert not missing, (mod.__name__, missing)


def test_exact_sums_are_bit_identical_to_member_order() -> None:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 8, generator=g) * 10.0 ** (3 * i) for i in range(5)]
    want = xs[0]
    for x in xs[1:]:
        want = want + x
    assert torch.equal(collectives.reduce(xs, ReduceOp.SUM, exact=True), want)
    pieces = [collectives.reduce_scatter(xs, 1, k, exact=True) for k in range(5)]
    assert [p.shape[1] for p in pieces] == [2, 2, 2, 1, 1]
    assert torch.equal(torch.cat(pieces, 1), want)
    assert torch.allclose(collectives.reduce(xs, ReduceOp.SUM), want)  # fast path: within rounding
    assert collectives.reduce(xs[:1], ReduceOp.SUM) is xs[0]


def test_collective_values() -> None:
    xs = [torch.arange(6.0).view(2, 3) + 10 * i for i in range(3)]
    assert torch.equal(collectives.all_gather(xs, 0), torch.cat(xs, 0))
    assert torch.equal(collectives.all_to_all(xs, 1, 0, 2), torch.cat([x[:, 2:] for x in xs], 0))
    assert torch.equal(collectives.ppermute(xs, 0, [(2, 0)]), xs[2])
    assert torch.equal(collectives.ppermute(xs, 1, [(2, 0)]), torch.zeros(2, 3))
    assert torch.equal(collectives.reduce(xs, ReduceOp.MAX), xs[2])
    assert torch.equal(collectives.reduce(xs, ReduceOp.MIN), xs[0])


def test_max_ties_split_the_gradient_evenly() -> None:
    for op in (ReduceOp.MAX, ReduceOp.MIN):
        xs = [torch.ones(3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
        collectives.reduce(xs, op).sum().backward()
        assert all(torch.equal(x.grad, torch.full((3,), 0.25, dtype=torch.float64))
                   for x in xs), op


def test_one_autograd_family() -> None:
    specs = [v for v in vars(functions).values()
             if isinstance(v, type) and issubclass(v, functions.Spec) and v is not functions.Spec]
    assert len(specs) == 11
    families = [v for mod in (functions, process, simulated)
                for v in vars(mod).values()
                if isinstance(v, type) and issubclass(v, torch.autograd.Function)
                and v is not torch.autograd.Function]
    assert families == [functions.Collective]
    # Without autograd recording, run() calls the spec's forward directly.
    x = torch.ones(2)
    assert functions.run(functions.TakeFirst(), x).data_ptr() == x.data_ptr()
    y = torch.ones(2, requires_grad=True)
    functions.run(functions.TakeFirst(), y).sum().backward()
    assert torch.equal(y.grad, torch.zeros(2))
