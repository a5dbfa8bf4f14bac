"""torch-native section: torch ops and a training step on shardwise Tensors beside torch.

- ``ops``: 8x8 float32 Sharded(0) over 4 virtual devices; each op beside the same op
  on the global tensor in plain torch (``clone`` stands in for the all_gather);
  the target is an overhead of at most 15 us per op (``x * 2 + 1`` is two ops).
- ``mlp``: one training step (forward, backward, AdamW step) of the Megatron MLP
  16 -> 64 -> 8 on a simulated 2x4 mesh (dp x tp, batch 32) beside the same model
  in plain torch on one device; the target is at most 3x.
- ``gpt``: one training step of the GPT in ``examples/gpt.py`` (its default Config, and
  dim=256) with Megatron tensor parallelism on tp (wq/wk/wv/w1 Sharded(0), wo/w2
  weights Sharded(1), the rest Replicated; batch Sharded(0) on dp) on the same mesh,
  batch 8, beside the same model in plain torch; targets: 3x (default), 1.5x (dim=256).
- ``planned``: the path users take (issue 22): the same GPT as a plain nn.Module with
  ``parallelize_module`` (examples/gpt.py's plan on tp) x ``fully_shard`` (per block and
  root on dp) on a simulated 2x2 mesh, the loss under ``loss_parallel``, at the default
  Config and dim=256 (targets 2.5x, 1.2x); a tiny HF Llama (``hf_plan`` on tp x
  ``fully_shard`` on dp, target 2.5x), skipped with the reason without transformers.
Cases are interleaved (see :mod:`benchmarks.timing`); one torch thread. Ops and training
steps are timed in this process's CPU time (``clock: process_time``: single-threaded, so the
same as wall time on an idle machine, and robust to a loaded one). Rows give the median
and the minimum over rounds; ``ratio`` is the medians', ``ratio_min`` the minima's.
:func:`training_steps` with ``device="cuda"`` runs the training steps on a simulated
mesh of virtual devices on one GPU (``init_device_mesh(..., devices_per_gpu=n)``) beside
torch on that GPU, in wall time up to the end of each step's kernels
(``clock: perf_counter+sync``).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from benchmarks.common import example_gpt
from benchmarks.timing import interleave
from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded

__all__ = ["run", "training_steps"]


def _ops(repeat: int, inner: int) -> list[dict[str, Any]]:
    mesh = DeviceMesh.cpu(4, "x")
    g = torch.randn(8, 8)
    x = sw.tensor(g, sharding=PlacementMapping(mesh, (Sharded(0),)))
    pairs = {
        "sw.all_gather (vs clone)": (lambda: sw.all_gather(x), lambda: g.clone()),
        "torch.add": (lambda: torch.add(x, x), lambda: torch.add(g, g)),
        "F.gelu": (lambda: F.gelu(x), lambda: F.gelu(g)),
        "x * 2 + 1 (two ops)": (lambda: x * 2 + 1, lambda: g * 2 + 1),
    }
    cases = {}
    for name, (ours, theirs) in pairs.items():
        cases[f"{name}/sw"] = ours
        cases[f"{name}/torch"] = theirs
    t = interleave(cases, repeat, inner=inner, clock=time.process_time)
    rows = []
    for name in pairs:
        a, b = t[f"{name}/sw"], t[f"{name}/torch"]
        assert a is not None and b is not None
        rows.append({"case": name, "shardwise_us": a["median_s"] * 1e6,
                     "torch_us": b["median_s"] * 1e6,
                     "overhead_us": (a["median_s"] - b["median_s"]) * 1e6})
    return rows


def _mesh(shape: tuple[int, ...], names: tuple[str, ...], device: str) -> DeviceMesh:
    """The simulated mesh on ``device``: virtual CPUs, or every device on one GPU."""
    if device == "cpu":
        return DeviceMesh.cpu(shape, names)
    return sw.init_device_mesh(device, shape, names, devices_per_gpu=math.prod(shape))


def _dev(device: str) -> torch.device:
    return torch.device("cpu") if device == "cpu" else torch.device(device, 0)


def _mlp(repeat: int, inner: int, device: str = "cpu") -> dict[str, Any]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8)).to(_dev(device))
    model = copy.deepcopy(ref)
    mesh = _mesh((2, 4), ("dp", "tp"), device)
    R = Replicated()

    def put(p: Any, *places: Any) -> nn.Parameter:
        return nn.Parameter(sw.tensor(p.detach(), sharding=PlacementMapping(mesh, places)))

    model[0].weight = put(model[0].weight, R, Sharded(0))
    model[0].bias = put(model[0].bias, R, Sharded(0))
    model[2].weight = put(model[2].weight, R, Sharded(1))
    model[2].bias = put(model[2].bias, R, R)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x, y = torch.randn(32, 16).to(_dev(device)), torch.randn(32, 8).to(_dev(device))
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, (Sharded(0), R)))
    ys = sw.tensor(y, sharding=PlacementMapping(mesh, (Sharded(0), R)))

    def step_sw() -> None:
        opt.zero_grad()
        ((model(xs) - ys) ** 2).mean().backward()
        opt.step()

    def step_torch() -> None:
        ropt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ropt.step()

    return _row("Megatron MLP 16->64->8, AdamW, DeviceMesh(dp=2, tp=4), batch 32",
                step_sw, step_torch, repeat, inner, device)


def _row(case: str, ours: Any, theirs: Any, repeat: int, inner: int,
         device: str = "cpu") -> dict[str, Any]:
    clock: Any = time.process_time
    if device != "cpu":   # (wall time, up to the end of the steps' kernels)
        ours, theirs, clock = _synced(ours), _synced(theirs), time.perf_counter
    t = interleave({"sw": ours, "torch": theirs}, repeat, inner=inner, clock=clock)
    a, b = t["sw"], t["torch"]
    assert a is not None and b is not None
    return {"case": case, "clock": "process_time" if device == "cpu" else "perf_counter+sync",
            "device": device, "shardwise_ms": a["median_s"] * 1e3,
            "torch_ms": b["median_s"] * 1e3, "ratio": a["median_s"] / b["median_s"],
            "shardwise_min_ms": a["min_s"] * 1e3, "torch_min_ms": b["min_s"] * 1e3,
            "ratio_min": a["min_s"] / b["min_s"]}


def _synced(fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> None:
        fn()
        torch.cuda.synchronize()
    return call


def _gpt(dim: int, repeat: int, inner: int, device: str = "cpu") -> dict[str, Any]:
    """The GPT sharded by hand (examples/gpt.py's ``megatron_by_hand``) on dp=2 x tp=4."""
    gpt = example_gpt()
    mesh = _mesh((2, 4), ("dp", "tp"), device)
    return _gpt_row(dim, mesh, lambda ref: gpt.megatron_by_hand(ref, mesh), False,
                    "Megatron TP", repeat, inner, device)


PLANNED_MESH = (2, 2)  # dp x tp, as the issue measured (issue 22)


def _gpt_planned(dim: int, repeat: int, inner: int, device: str = "cpu") -> dict[str, Any]:
    """The GPT as users build it: a plain nn.Module, ``parallelize_module`` with
    examples/gpt.py's Megatron plan on tp, ``fully_shard`` per block and on the root
    over dp (``gpt.parallelize``), the loss under ``loss_parallel``."""
    gpt = example_gpt()
    mesh = _mesh(PLANNED_MESH, ("dp", "tp"), device)
    return _gpt_row(dim, mesh, lambda ref: gpt.parallelize(ref, mesh), True,
                    "plan TP x fully_shard", repeat, inner, device)


def _gpt_row(dim: int, mesh: DeviceMesh, build: Callable[[Any], Any], in_loss_parallel: bool,
             how: str, repeat: int, inner: int, device: str = "cpu") -> dict[str, Any]:
    """A training step (AdamW, batch 8) of ``build(copy of the GPT)`` on ``mesh`` beside
    the single-device GPT; ``in_loss_parallel``: forward and backward under
    ``loss_parallel``."""
    from shardwise.parallel import loss_parallel

    gpt = example_gpt()
    c = gpt.Config(dim=dim)
    torch.manual_seed(0)
    ref = gpt.GPT(c).to(_dev(device))
    model = build(copy.deepcopy(ref))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x, y = (t.to(_dev(device)) for t in gpt.batch(c, 8, 0))
    data = PlacementMapping(mesh, (Sharded(0), Replicated()))
    xs, ys = sw.tensor(x, sharding=data), sw.tensor(y, sharding=data)
    scope = loss_parallel if in_loss_parallel else contextlib.nullcontext

    def step_sw() -> None:
        with scope():
            model(xs, ys).backward()
        opt.step()
        opt.zero_grad()

    def step_torch() -> None:
        ref(x, y).backward()
        ropt.step()
        ropt.zero_grad()

    dp, tp = mesh.shape
    case = (f"GPT V={c.vocab} T={c.seq} D={c.dim} H={c.heads} L={c.layers}, {how}, AdamW, "
            f"DeviceMesh(dp={dp}, tp={tp}), batch 8")
    return {"dim": dim, **_row(case, step_sw, step_torch, repeat, inner, device)}


def _llama(repeat: int, inner: int) -> dict[str, Any]:
    """A tiny HF Llama (tests/parallel/test_hf.py's config) with its own plan
    (``hf_plan``) on tp and ``fully_shard`` per layer and on the root over dp; skipped
    with the reason when transformers (a test-only dependency) is missing."""
    try:
        import transformers as T
    except ImportError as e:
        return {"case": "tiny HF Llama TP x FSDP", "skipped": f"transformers missing ({e})"}
    from shardwise.parallel import fully_shard, hf_plan, parallelize_module

    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    mesh = DeviceMesh.cpu(PLANNED_MESH, ("dp", "tp"))
    model = parallelize_module(copy.deepcopy(ref), mesh, hf_plan(ref), axis="tp")
    for layer in model.model.layers:
        fully_shard(layer, mesh, axis="dp")
    fully_shard(model, mesh, axis="dp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    data = PlacementMapping(mesh, (Sharded(0), Replicated()))
    sids = sw.tensor(ids, sharding=data)

    def step_sw() -> None:
        model(sids, labels=sids).loss.backward()
        opt.step()
        opt.zero_grad()

    def step_torch() -> None:
        ref(ids, labels=ids).loss.backward()
        ropt.step()
        ropt.zero_grad()

    dp, tp = PLANNED_MESH
    case = (f"tiny HF Llama (D=64, L=2, V=128), hf_plan TP x fully_shard, AdamW, "
            f"DeviceMesh(dp={dp}, tp={tp}), batch 8x16")
    return _row(case, step_sw, step_torch, repeat, inner)


def training_steps(repeat: int, inner: int, device: str = "cpu", dims: tuple[int, ...] = (32,)
                   ) -> list[dict[str, Any]]:
    """The training steps beside torch on ``device`` (see the module doc): the Megatron
    MLP, then the GPT by hand and planned at each of ``dims`` (``inner`` steps timed
    together for the MLP, a tenth of them for the GPTs, one for dims above 64)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [_mlp(repeat, inner, device)]
        for build in (_gpt, _gpt_planned):
            rows += [build(d, repeat, max(inner // 10, 1) if d <= 64 else 1, device)
                     for d in dims]
        return rows
    finally:
        torch.set_num_threads(threads)


def run(repeat: int = 15, inner: int = 200) -> dict[str, Any]:
    """Every case as JSON-ready rows (one torch thread during the run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"ops": _ops(repeat, inner), "mlp": _mlp(repeat, max(inner // 20, 5)),
                "gpt": [_gpt(32, repeat, max(inner // 100, 1)), _gpt(256, repeat, 1)],
                "planned": [_gpt_planned(32, repeat, max(inner // 100, 1)),
                            _gpt_planned(256, repeat, 1),
                            _llama(repeat, max(inner // 100, 1))]}
    finally:
        torch.set_num_threads(threads)


def tables(res: dict[str, Any]) -> list[str]:
    lines = ["", "torch-native ops, 8x8 float32 Sharded(0) on 4 virtual devices (median us):",
             f"  {'op':<26} {'shardwise':>10} {'torch':>8} {'overhead':>9}"]
    for r in res["ops"]:
        lines.append(f"  {r['case']:<26} {r['shardwise_us']:>10.1f} {r['torch_us']:>8.1f} "
                     f"{r['overhead_us']:>9.1f}")
    lines.append("training steps (median ms; ratio of medians, of minima):")
    for m in [res["mlp"], *res.get("gpt", []), *res.get("planned", [])]:
        if "skipped" in m:
            lines.append(f"  {m['case']}: skipped ({m['skipped']})")
            continue
        lines.append(f"  {m['case']}: shardwise {m['shardwise_ms']:.3f} ms, torch "
                     f"{m['torch_ms']:.3f} ms, {m['ratio']:.2f}x (min {m['ratio_min']:.2f}x)")
    return lines


def main() -> int:
    print("\n".join(tables(run())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
