"""The compile section's Llama rows beside DTensor: eager and compiled, forward and
training step, on Gloo ranks (and shardwise alone on the simulated mesh).

- The model: a tiny HF ``LlamaForCausalLM`` (2 layers, hidden 64, 4 heads, 2 KV heads:
  GQA; on 4 ranks 8 and 4, since DTensor's local views need a KV head per rank; vocab
  128; eager attention), batch 4 x 64 tokens, Megatron tensor parallelism
  over every rank (q/k/v/gate/up Colwise, o/down Rowwise): shardwise's
  ``parallelize_module`` beside torch's DTensor one, the same plan.
- Cases: ``forward`` (logits, ``no_grad``) and ``train`` (forward, cross-entropy,
  backward, gradients cleared), each ``eager`` and ``compiled`` (``torch.compile(model,
  dynamic=False)``, inductor, for both: shardwise routes torch's backend to
  ``shardwise.compile_backend`` for its graphs).
- Per case: the median and min over ranks' max (:func:`benchmarks.common.dist_time`),
  the graph breaks and frames Dynamo compiled, and the first call's seconds.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import time
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["parser", "rank_body", "run", "simulated", "tables"]

PLAN = {"model.layers.*.self_attn.[qkv]_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise"}


def _reference(tp: int = 2) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The tiny Llama with ``tp`` kv heads (at least 2) and twice as many query heads:
    GQA, and DTensor's local views need a kv head per rank at least."""
    from transformers import LlamaConfig, LlamaForCausalLM

    attn: dict[str, Any] = {"attn_implementation": "eager"}  # (not in its typed signature)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=2 * max(tp, 2),
                      num_key_value_heads=max(tp, 2),
                      max_position_embeddings=128, **attn)
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 65), generator=torch.Generator().manual_seed(1))
    return LlamaForCausalLM(cfg), ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _shardwise(ref: Any, mesh: Any) -> Any:
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return parallelize_module(copy.deepcopy(ref), mesh, {k: styles[v]() for k, v in
                                                          PLAN.items()}, axis="tp")


def _dtensor(ref: Any, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,))
    for name, _ in list(model.named_modules()):
        for pattern, style in PLAN.items():
            if fnmatch.fnmatchcase(name, pattern):
                parallelize_module(model.get_submodule(name), mesh, styles[style]())
    return model


def _plain(t: Any) -> torch.Tensor:
    return t.to_torch() if hasattr(t, "to_torch") else t


def _cases(model: Any, compiled: Any, ids: torch.Tensor, labels: torch.Tensor
           ) -> dict[str, Any]:
    def forward(m: Any) -> Any:
        def call() -> Any:
            with torch.no_grad():
                return m(input_ids=ids, use_cache=False).logits
        return call

    def train(m: Any) -> Any:
        def call() -> Any:
            logits = m(input_ids=ids, use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss
        return call

    return {"forward eager": forward(model), "forward compiled": forward(compiled),
            "train eager": train(model), "train compiled": train(compiled)}


def _warm(cases: dict[str, Any]) -> dict[str, Any]:
    """First calls (the compiles), their seconds, Dynamo's counts, and the largest
    difference of a compiled result (logits, loss) from the eager one."""
    from torch._dynamo.utils import counters

    counters.clear()  # (not torch._dynamo.reset(): another library's graphs stay)
    first, got = {}, {}
    for name, call in cases.items():
        t0 = time.perf_counter()
        got[name] = _plain(call()).detach()
        first[name] = time.perf_counter() - t0
    diff = max((got[f"{k} compiled"] - got[f"{k} eager"]).abs().max().item()
               for k in ("forward", "train"))
    return {"first_s": first, "max_abs_diff": diff,
            "graph_breaks": sum(counters["graph_break"].values()),
            "frames": counters["frames"]["total"], "unique_graphs":
            counters["stats"]["unique_graphs"]}


def rank_body(args: argparse.Namespace) -> dict[str, Any]:
    """One Gloo rank: DTensor's and shardwise's cases, all timed interleaved (one call of
    each per round), so that the shared machine's load hits both libraries alike."""
    import torch.distributed as dist

    from benchmarks.common import dist_time
    from shardwise import DeviceMesh

    torch.set_num_threads(1)
    world = dist.get_world_size()
    ref, ids, labels = _reference(world)
    out: dict[str, Any] = {"world": world}
    every: dict[str, Any] = {}
    for lib in args.libs.split(","):
        if lib == "dtensor":
            model = _dtensor(ref, world)
            compiled = torch.compile(model, dynamic=False)
        else:
            model = _shardwise(ref, DeviceMesh.cpu(world, "tp"))
            compiled = torch.compile(model, dynamic=False)  # (inductor, as for DTensor)
        cases = _cases(model, compiled, ids, labels)
        out[lib] = _warm(cases)
        every.update({f"{lib}|{k}": v for k, v in cases.items()})
    for key, t in dist_time(every, args.repeat, shuffle=True).items():
        lib, case = key.split("|")
        out[lib].setdefault("ms", {})[case] = None if t is None else t["median"] * 1e3
        out[lib].setdefault("min_ms", {})[case] = None if t is None else t["min"] * 1e3
    return out


def simulated(repeat: int) -> dict[str, Any]:
    """shardwise's cases on ``DeviceMesh.cpu(2, 'tp')`` in this process."""
    from benchmarks.timing import interleave
    from shardwise import DeviceMesh

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref, ids, labels = _reference()
        model = _shardwise(ref, DeviceMesh.cpu(2, "tp"))
        compiled = torch.compile(model, dynamic=False)
        cases = _cases(model, compiled, ids, labels)
        warm = _warm(cases)
        t = interleave(cases, repeat, clock=time.process_time)
        return {**warm, "ms": {k: v["median_s"] * 1e3 for k, v in t.items() if v},
                "min_ms": {k: v["min_s"] * 1e3 for k, v in t.items() if v}}
    finally:
        torch.set_num_threads(threads)


def parser() -> argparse.ArgumentParser:
    from benchmarks.common import launch_flags

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--libs", default="dtensor,shardwise")
    p.add_argument("--no-simulated", action="store_true")
    p.add_argument("--out", default="benchmarks/results/compile.json")
    return launch_flags(p, 2)


def run(*, world: int = 2, repeat: int = 15, libs: str = "dtensor,shardwise",
        no_simulated: bool = False, **launch: Any) -> dict[str, Any]:
    """The Llama rows: on ``world`` Gloo ranks (DTensor and shardwise) and simulated."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed (pip install transformers)"}
    from benchmarks.common import run_launched

    res: dict[str, Any] = {"case": "tiny HF Llama (2 layers, hidden 64, GQA, eager "
                                   "attention), batch 4 x 64, Megatron TP"}
    res["gloo"] = run_launched(parser, rank_body, dict(world=world, repeat=repeat,
                                                       libs=libs, **launch))
    if not no_simulated:
        res["simulated"] = simulated(repeat)
    return res


def tables(res: dict[str, Any]) -> list[str]:
    if "skipped" in res:
        return [f"compile, Llama: skipped: {res['skipped']}"]
    lines = [f"compile: {res['case']} (median ms; first call s; graph breaks)"]
    rows = []
    gloo = res.get("gloo") or {}
    for lib in ("dtensor", "shardwise"):
        if lib in gloo:
            rows.append((f"{lib}, {gloo['world']} Gloo ranks", gloo[lib]))
    if "simulated" in res:
        rows.append(("shardwise, DeviceMesh.cpu(2)", res["simulated"]))
    for label, r in rows:
        ms, first = r["ms"], r["first_s"]
        lines.append(
            f"  {label:30} fwd eager {ms['forward eager']:7.2f}  compiled "
            f"{ms['forward compiled']:7.2f} | train eager {ms['train eager']:7.2f}  compiled "
            f"{ms['train compiled']:7.2f} | first compiled fwd {first['forward compiled']:.1f}"
            f" s, train {first['train compiled']:.1f} s; breaks {r['graph_breaks']}, "
            f"graphs {r['unique_graphs']}, max |compiled - eager| {r['max_abs_diff']:.1e}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.compiled_llama [--world N] [--libs ...] [--out FILE]``."""
    from benchmarks.common import write_json

    args = parser().parse_args(argv)
    res = run(**{k.replace("-", "_"): v for k, v in vars(args).items() if k != "out"})
    path = write_json(args.out, res)
    print("\n".join(tables(res)) + f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
