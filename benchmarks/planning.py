"""Plan before you buy (issue 36): ``shardwise.estimate``'s predicted step time against
the measured one, and how long planning takes at 1,000+ devices.

- ``calibrate``: ``shardwise.calibrate``'s measurements on the Gloo processes, one
  round before each round of steps (the profile of their medians), so the profile and
  the steps are measured under the same load from other jobs.
- ``plans``: a small GPT (examples/gpt.py's architecture and sizes class: the planner's
  decoder, whose embedding is one child so that pipelines can cut it) under 13 plans on
  ``--world`` Gloo ranks: data parallel, FSDP, Megatron tensor parallel (with FSDP, with
  loss parallel), recompute, a bad column-column pairing, an idle ``tp`` axis, and
  pipelines; each predicted on the simulated mesh with the calibrated profile and
  measured (the slowest rank, median of ``--repeat`` rounds after 2 warm-ups; each
  round steps every plan once, so the machine's other load falls on all of them).
  Reported: each error, how many are within 20%, the rank correlation (Spearman), and
  ``auto_plan``'s pick against the measured fastest.
- ``scale`` (fresh processes, wall time and peak RSS): the Llama-3-8B-sized config on
  1,024 devices (dp 128 x tp 8, Megatron, FSDP), the 70B-sized one on 4,096 devices
  (dp 512 x tp 8), and ``auto_plan`` for the 8B config on 1,024 devices.

    python -m benchmarks.planning                  # from the repo root
    python -m benchmarks.planning --no-scale --repeat 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

__all__ = ["PLANS", "main", "run"]

MEGATRON = (("layers.*.attn.wq", "colwise"), ("layers.*.attn.wk", "colwise"),
            ("layers.*.attn.wv", "colwise"), ("layers.*.attn.wo", "rowwise"),
            ("layers.*.mlp.w1", "colwise"), ("layers.*.mlp.w2", "rowwise"))
COLCOL = tuple((p, "colwise") for p, _ in MEGATRON)
HEAD = (("head", "colwise_sharded"),)


def _plans() -> list[Any]:
    from shardwise.planning import ParallelPlan as P

    return [
        P(dp=4), P(dp=4, fsdp=True), P(dp=2, tp=2, styles=MEGATRON),
        P(dp=2, tp=2, fsdp=True, styles=MEGATRON), P(tp=4, styles=MEGATRON),
        P(tp=4, styles=MEGATRON + HEAD), P(dp=2, tp=2, styles=MEGATRON, recompute=True),
        P(dp=4, recompute=True), P(dp=2, tp=2, styles=COLCOL), P(dp=2, tp=2),
        P(pp=2, dp=2, microbatches=4), P(pp=2, tp=2, styles=MEGATRON, microbatches=4),
        P(pp=4, schedule="GPipe", microbatches=4)]


PLANS = _plans


def _config(quick: bool) -> Any:
    from shardwise.planning import ModelConfig

    if quick:
        return ModelConfig.gpt(vocab=256, seq=64, dim=128, heads=4, layers=4)
    return ModelConfig.gpt(vocab=512, seq=128, dim=256, heads=8, layers=4)


def _measure_all(args: dict[str, Any]) -> dict[str, Any]:
    """On every rank: each plan's step time (the slowest rank's), the median over
    ``repeat`` rounds, each round stepping every plan once in turn (with ``calibrate``,
    after one round of ``calibrate``'s measurements): load from other jobs on the
    machine then falls on every plan, and on the profile, alike."""
    import statistics

    import torch
    import torch.distributed as dist

    from shardwise.planning import Transformer
    from shardwise.planning.calibration import measurements
    from shardwise.planning.search import inputs, train_step
    from shardwise.planning.transformer import loss_fn

    config, batch, repeat = args["config"], args["batch"], args["repeat"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab, (batch, config.seq + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    steps = []
    for plan in args["plans"]:
        torch.manual_seed(0)
        target = plan.apply(Transformer(config), loss_fn=loss_fn)
        params = target.pipe.parameters() if hasattr(target, "pipe") else target.parameters()
        opt = torch.optim.AdamW(list(params), lr=1e-4, foreach=True)
        meshes = ([target.pipe.stages[0].mesh, target.pipe.stages[-1].mesh]
                  if hasattr(target, "pipe") else [plan.mesh()] * 2)

        def step(target: Any = target, opt: Any = opt, meshes: Any = meshes) -> None:
            train_step(target, opt, inputs(meshes[0], x), inputs(meshes[1], y))
        step()
        step()
        steps.append(step)
    times = torch.zeros(repeat, len(steps), dtype=torch.float64)
    rounds = []
    for r in range(repeat):
        if args["calibrate"]:  # calibrate's figures under the same load as the steps
            rounds.append(measurements(1))
        for i, step in enumerate(steps):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times[r, i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {"times": [float(statistics.median(times[:, i].tolist()))
                      for i in range(len(steps))], "rounds": rounds}


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb))
    return 1 - 6 * d2 / (n * (n * n - 1)) if n > 1 else 1.0


def compare(world: int = 4, repeat: int = 5, quick: bool = False,
            log: Any = None) -> dict[str, Any]:
    """Calibrate, predict and measure every plan, and ``auto_plan``'s pick."""
    from shardwise.planning import auto_plan, estimate_plan
    from shardwise.planning.calibration import profile_of, spawn

    say = log or (lambda msg: None)
    config, batch = _config(quick), 16
    plans = _plans()
    say(f"measure {len(plans)} plans on {world} Gloo ranks, calibrating between rounds ...")
    t0 = time.perf_counter()
    got = spawn(_measure_all, {"config": config, "batch": batch, "repeat": repeat,
                               "plans": plans, "calibrate": True}, world, limit_s=1800)
    measure_s = time.perf_counter() - t0
    measured = got["times"]
    profile = profile_of(got["rounds"], world)
    say(f"predict {len(plans)} plans (simulated mesh, fake tensors) ...")
    predicted = [estimate_plan(config, p, batch=batch, profile=profile).time_s for p in plans]
    say("auto_plan with the calibrated profile ...")
    choice = auto_plan(config, devices=world, batch=batch, profile=profile,
                       memory_budget=profile.memory, refine=3)
    fastest = min(measured)
    if choice.plan in plans:
        pick_measured = measured[plans.index(choice.plan)]
    else:  # measured beside the fastest, interleaved: their ratio, at the first's load
        best = plans[measured.index(fastest)]
        say(f"measure auto_plan's pick {choice.plan} beside {best} ...")
        two = spawn(_measure_all, {"config": config, "batch": batch, "repeat": repeat,
                                   "plans": [choice.plan, best], "calibrate": False},
                    world, limit_s=1800)["times"]
        pick_measured = fastest * two[0] / two[1]
    rows = []
    for p, pred, meas in zip(plans, predicted, measured):
        rows.append({"plan": str(p), "predicted_ms": pred * 1e3, "measured_ms": meas * 1e3,
                     "error": pred / meas - 1})
    return {
        "model": {"config": str(config), "batch": batch, "world": world},
        "profile": {"flops_float32": profile.flops["float32"],
                    "memory_bandwidth": profile.memory_bandwidth,
                    "op_overhead_us": profile.op_overhead * 1e6,
                    "kernel_overhead_us": profile.kernel_overhead * 1e6,
                    "links": {f"{n}x stride {s}": {"alpha_us": lk.alpha * 1e6,
                                                   "beta_ns_per_byte": lk.beta * 1e9}
                              for (n, s), lk in sorted(profile.groups.items())},
                    "p2p": None if profile.p2p is None else {
                        "alpha_us": profile.p2p.alpha * 1e6,
                        "beta_ns_per_byte": profile.p2p.beta * 1e9},
                    "measure_s": measure_s},
        "plans": rows,
        "within_20": sum(abs(r["error"]) <= 0.2 for r in rows),
        "spearman": _spearman([r["predicted_ms"] for r in rows],
                              [r["measured_ms"] for r in rows]),
        "auto_plan": {"plan": str(choice.plan), "predicted_ms": choice.estimate.time_s * 1e3,
                      "measured_ms": pick_measured * 1e3, "fastest_ms": fastest * 1e3,
                      "over_fastest": pick_measured / fastest - 1},
    }


_SCALE = r'''
import json, resource, sys, time
import torch
from shardwise.planning import ModelConfig, ParallelPlan, auto_plan, estimate_plan
case = sys.argv[1]
t0 = time.perf_counter()
megatron = %r
if case == "auto8b":
    choice = auto_plan(ModelConfig.llama3_8b(), devices=1024, batch=1024, max_pp=4, refine=2)
    out = {"plan": str(choice.plan), "time_s": choice.estimate.time_s,
           "peak_gib": choice.estimate.memory.peak / 2**30}
else:
    cfg = ModelConfig.llama3_8b() if case == "8b" else ModelConfig.llama3_70b()
    dp = 128 if case == "8b" else 512
    styles = megatron + (("layers.*.mlp.w3", "colwise"), ("head", "colwise_sharded"),
                         ("embed.tok", "rowwise"))
    plan = ParallelPlan(dp=dp, tp=8, fsdp=True, styles=styles)
    est = estimate_plan(cfg, plan, batch=1024 if case == "8b" else 2048)
    out = {"plan": str(plan), "time_s": est.time_s, "peak_gib": est.memory.peak / 2**30,
           "all_reduce_tp": est.counts.get("all_reduce", 0)}
out["seconds"] = time.perf_counter() - t0
# this process's own peak (VmHWM: reset by exec), where Linux keeps ru_maxrss across
# exec, so that it counts the parent that forked it (the whole bench)
try:
    hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
    out["max_rss_mib"] = int(hwm.split()[1]) / 1024
except (OSError, IndexError):
    out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
'''


def scale(cases: tuple[str, ...] = ("8b", "70b", "auto8b"), log: Any = None,
          limit_s: float = 300.0) -> list[dict[str, Any]]:
    """Each case in a fresh process: its result, wall time and peak RSS."""
    say = log or (lambda msg: None)
    rows = []
    for case in cases:
        say(f"scale: {case} in a fresh process ...")
        code = _SCALE % (MEGATRON,)
        try:
            done = subprocess.run([sys.executable, "-c", code, case], capture_output=True,
                                  text=True, timeout=limit_s, check=False)
            lines = done.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "error": done.stderr.strip().splitlines()[-1:] or ["failed"]}
        except subprocess.TimeoutExpired:
            row = {"error": f"over {limit_s:.0f} s"}
        rows.append({"case": case, **row})
    return rows


def run(world: int = 4, repeat: int = 5, quick: bool = False, do_scale: bool = True,
        log: Any = None) -> dict[str, Any]:
    out = compare(world, repeat, quick, log)
    out["scale"] = scale(log=log) if do_scale else []
    return out


def table(res: dict[str, Any]) -> str:
    lines = [f"planning: {res['model']['config']}, batch {res['model']['batch']}, "
             f"{res['model']['world']} Gloo ranks",
             f"  {'plan':58} {'predicted':>10} {'measured':>10} {'error':>7}"]
    for r in res["plans"]:
        lines.append(f"  {r['plan'][:58]:58} {r['predicted_ms']:8.1f}ms "
                     f"{r['measured_ms']:8.1f}ms {r['error']:+7.0%}")
    a = res["auto_plan"]
    lines.append(f"  within 20%: {res['within_20']} of {len(res['plans'])}; Spearman "
                 f"{res['spearman']:.2f}; auto_plan: {a['plan']} measured "
                 f"{a['measured_ms']:.1f} ms, {a['over_fastest']:+.0%} over the fastest "
                 f"({a['fastest_ms']:.1f} ms)")
    for r in res.get("scale", []):
        if "error" in r:
            lines.append(f"  scale {r['case']}: {r['error']}")
        else:
            lines.append(f"  scale {r['case']}: {r['plan']}: {r['seconds']:.1f} s, "
                         f"{r['max_rss_mib']:.0f} MiB RSS; predicted {r['time_s']:.2f} "
                         f"s/step, peak {r['peak_gib']:.1f} GiB/device")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a smaller GPT, fewer repeats")
    p.add_argument("--no-scale", action="store_true", help="skip the 1,000+ device rows")
    p.add_argument("--out", default=None, metavar="FILE", help="write the JSON result here")
    args = p.parse_args(argv)
    res = run(args.world, args.repeat, args.quick, not args.no_scale,
              log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(table(res))
    if args.out:
        from benchmarks.common import write_json

        write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
