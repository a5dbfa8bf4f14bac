"""The GPT of ``gpt.py`` trained with pipeline x data x tensor parallelism (3-D).

The model is the same blocks in a GPT whose forward is a chain of its children
(embedding, ``layers``, norm, head), which is what ``pipeline(model, split_points=...)``
cuts. Each stage is then parallelized like any module: ``parallelize_module`` over
``tp`` and ``fully_shard`` over ``dp`` on the stage's ``(dp, tp)`` mesh. Every step is
checked against single-device torch.

    python examples/gpt_pp.py --pp 2                       # simulated 2x2x2 mesh
    python examples/gpt_pp.py --pp 4 --mesh 4x1x1 --schedule ZBVZeroBubble
    torchrun --nproc-per-node 4 examples/gpt_pp.py --mesh 2x1x2
    torchrun --nproc-per-node 2 examples/gpt_pp.py --backend nccl --mesh 2x1x1  # 2 GPUs
    python examples/gpt_pp.py --mesh 2x1x2 --device cuda --devices-per-gpu 4  # one GPU
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


def _gpt() -> Any:
    """``gpt.py`` as a module (examples/ is not a package), under the one name the
    tests and benchmarks load it by."""
    name = "shardwise_example_gpt"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("gpt.py"))
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # its dataclasses look their module up here
        spec.loader.exec_module(mod)
    return mod


gpt = _gpt()
Config = gpt.Config


class Embed(nn.Module):
    """Token plus position embedding as one child, so one stage holds both."""

    def __init__(self, c: Any) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class PipeGPT(nn.Module):
    """``gpt.py``'s GPT returning logits; its forward applies its children in order."""

    def __init__(self, c: Any) -> None:
        super().__init__()
        self.embed = Embed(c)
        self.layers = nn.ModuleList(gpt.Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))


def tp_plan() -> dict[str, Any]:
    """Megatron tensor parallelism for :class:`PipeGPT` (a stage takes the entries of
    the modules it holds)."""
    from shardwise.parallel import ColwiseParallel, RowwiseParallel

    return {"layers.*.attn.w[qkv]": ColwiseParallel(), "layers.*.attn.wo": RowwiseParallel(),
            "layers.*.mlp.w1": ColwiseParallel(), "layers.*.mlp.w2": RowwiseParallel(),
            "head": ColwiseParallel()}


def split_points(layers: int, n_stages: int) -> list[str]:
    """Where stages begin: the layers cut as evenly as they go (stage 0 also holds the
    embedding, the last stage the norm and head).

    >>> split_points(4, 2), split_points(4, 4)
    (['layers.2'], ['layers.1', 'layers.2', 'layers.3'])
    """
    if not 1 <= n_stages <= layers:
        raise ValueError(f"{n_stages} stages need 1 <= stages <= layers ({layers}); "
                         "pass --layers of at least the stage count.")
    bounds = [round(s * layers / n_stages) for s in range(1, n_stages)]
    return [f"layers.{b}" for b in bounds]


def stage_plan(module: nn.Module, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """The entries of ``plan`` (default: :func:`tp_plan`) naming a module that the stage
    ``module`` holds (the others were cut away as ``nn.Identity``).

    >>> sorted(stage_plan(nn.ModuleDict({"head": nn.Linear(2, 2)})))
    ['head']
    """
    import fnmatch

    held = [n for n, m in module.named_modules() if n and not isinstance(m, nn.Identity)]
    return {k: v for k, v in (plan or tp_plan()).items()
            if any(fnmatch.fnmatchcase(n, k) for n in held)}


def parallelize(pipe: Any, *, tp: bool = True, fsdp: bool = True) -> Any:
    """TP over ``tp`` and FSDP over ``dp`` on every stage this process holds."""
    from shardwise.parallel import fully_shard, parallelize_module

    for st in pipe.local_stages:
        mod, mesh = st.module, st.mesh
        if tp and "tp" in mesh.axis_names:
            parallelize_module(mod, mesh, stage_plan(mod), axis="tp")
        if fsdp and "dp" in mesh.axis_names:
            for layer in getattr(mod, "layers", []):
                fully_shard(layer, mesh, axis="dp")
            fully_shard(mod, mesh, axis="dp")
    return pipe


def main(argv: list[str] | None = None) -> int:
    """Train with pipelining; exit 1 if a loss differs from single-device torch."""
    import argparse
    import copy

    import shardwise as sw
    from shardwise import PlacementMapping, Replicated, Sharded
    from shardwise import pipelining as pp
    from shardwise.distributed import maybe_initialize, process_count, process_index, shutdown

    p = argparse.ArgumentParser(description="Train a small GPT with PP x FSDP x TP.")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (default 2)")
    p.add_argument("--mesh", default=None,
                   help="pp x dp x tp, e.g. 2x2x2 (default: PP x 2 x 2 simulated, "
                        "PP x 1 x world/PP under torchrun)")
    p.add_argument("--schedule", default="1F1B", choices=pp.SCHEDULES)
    p.add_argument("--microbatches", type=int, default=None, help="default: 2 x stages")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--timeline", action="store_true",
                   help="print the schedule's simulated timeline")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="under torchrun: the process backend (default: nccl for --device "
                        "cuda, else gloo); on nccl the mesh is the processes' GPUs")
    gpt.device_flags(p)
    p.set_defaults(device=None)
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="under torchrun: the bound of every wait (initialize(timeout_s=))")
    p.add_argument("--pause-s", type=float, default=0.0,
                   help="sleep between steps (a receive posted ahead waits through it)")
    p.add_argument("--stall", default=None, metavar="RANK:SECONDS",
                   help="process RANK sleeps SECONDS before step 1 (a stalled stage: the "
                        "others raise CollectiveError within --timeout-s)")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    stall_rank, stall_s = stall_of(args.stall)
    multi = maybe_initialize(backend=args.backend or ("gloo" if args.device == "cpu" else
                                                      "nccl"), timeout_s=args.timeout_s)
    if args.backend and not multi:
        p.error(f"--backend {args.backend} needs torchrun (one process per device); "
                "without it the mesh is simulated")
    if args.mesh:
        size = tuple(int(v) for v in args.mesh.split("x"))
    elif multi:
        size = (args.pp, 1, process_count() // args.pp)
    else:
        size = (args.pp, 2, 2)
    mesh = sw.init_device_mesh(args.device, size, ("pp", "dp", "tp"),
                               devices_per_gpu=None if multi else args.devices_per_gpu)
    virtual = 1 if args.schedule in ("GPipe", "1F1B") else 2
    n_stages = size[0] * virtual
    m = args.microbatches or 2 * n_stages
    cfg = Config(dim=args.dim, layers=args.layers)
    torch.manual_seed(0)
    dev = gpt.reference_device(args.device)
    reference = PipeGPT(cfg).to(dev)   # initialized on the CPU, so every device starts alike
    pipe = pipeline_of(copy.deepcopy(reference), mesh, args.layers, n_stages, args.schedule)
    parallelize(pipe)
    sched = getattr(pp, f"Schedule{args.schedule}")(pipe, n_microbatches=m, loss_fn=loss_fn)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    where = f"torch.distributed, {process_count()} processes" if multi else "simulated"
    if args.device != "cpu" and not multi:
        where += f" on {args.device}"
    first, last = pipe.stages[0], pipe.stages[-1]
    say = print if last.is_local and (not multi or _first_holder(last)) else _quiet
    say(f"GPT {cfg} on {mesh!r} ({where}), {n_stages} stages, {args.schedule}, "
        f"{m} microbatches of {args.batch // m or 1}")
    sim = pp.simulate(sched)
    say(f"simulated (forward 1, backward 2 per stage): bubble {sim.bubble:.1%}, peak "
        f"in-flight microbatches per rank {list(sim.peak_inflight.values())}")
    if args.timeline:
        say(sim.timeline())
    data = PlacementMapping(first.mesh, (Sharded(0), Replicated()))
    labels = PlacementMapping(last.mesh, (Sharded(0), Replicated()))
    rows: list[tuple[int, float, float]] = []
    for step in range(args.steps):
        if step and args.pause_s:
            time.sleep(args.pause_s)
        if step == 1 and process_index() == stall_rank:
            time.sleep(stall_s)
        ids, targets = (t.to(dev) for t in gpt.batch(cfg, args.batch, step))
        losses: list[Any] = []
        sched.step(sw.tensor(ids, sharding=data) if first.is_local else None,
                   target=sw.tensor(targets, sharding=labels) if last.is_local else None,
                   losses=losses)
        pp.clip_grad_norm_(list(pipe.parameters()), 1.0, pipe=pipe)
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(reference(ids), targets)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        if losses:
            got = sum(float(v.detach()) for v in losses) / len(losses)
            rows.append((step, got, float(ref_loss.detach())))
    ok = gpt.parity(rows, args.rtol, say=say)
    if multi:
        shutdown()
    return 0 if ok else 1


def stall_of(text: str | None) -> tuple[int, float]:
    """``--stall RANK:SECONDS`` as (rank, seconds); (-1, 0.0) without one.

    >>> stall_of("1:15"), stall_of(None)
    ((1, 15.0), (-1, 0.0))
    """
    if not text:
        return -1, 0.0
    rank, _, seconds = text.partition(":")
    return int(rank), float(seconds or 0)


def pipeline_of(model: PipeGPT, mesh: Any, layers: int, n_stages: int, schedule: str) -> Any:
    """``model`` cut into ``n_stages`` on ``mesh``'s ``pp`` axis, placed as ``schedule``
    needs (V for ZBVZeroBubble, round-robin otherwise)."""
    from shardwise.pipelining import pipeline

    v = n_stages // mesh.axis_size("pp")
    return pipeline(model, mesh, split_points=split_points(layers, n_stages),
                    stages_per_rank=v, style="v" if schedule == "ZBVZeroBubble" else "loop")


def _first_holder(stage: Any) -> bool:
    """True on the first process of ``stage``'s mesh (it prints for the others)."""
    from shardwise.distributed import process_index

    return bool(stage.mesh.devices[0].id == process_index())


def _quiet(*args: object) -> None:
    pass


if __name__ == "__main__":
    raise SystemExit(main())
