"""``shardwise.auto_plan``: choose the degrees (pp x dp x tp), FSDP, each module's
tensor-parallel style and activation recompute for a model on N devices, by estimating
each candidate's step (``estimate``'s fake step) and keeping the fastest that fits.

Invariants:
- Every number comes from a step the candidate really runs (fake): collectives from
  the ops' own rules and the planner, so a new plan style or axis needs no formula here.
- Styles first: the model's linear modules are grouped by the input they read (q, k, v
  read one; so do SwiGLU's gate and up), the groups paired in the order a block calls
  them, and each pair's 3 x 3 styles (none, column, row) tried on one configuration;
  then the head (column-parallel kept sharded for ``loss_parallel``, or none) and the
  embedding (row-parallel, or none).
- A model given as a ``ModelConfig`` is estimated at one and two blocks per stage and
  extrapolated to its depth (a step's collectives, bytes and memory grow by a block's
  per block); the ``refine`` best are then estimated at full depth, which decides.
- Recompute is tried only for a configuration that does not fit without it (it saves
  memory and costs time). Pipelines are tried for the best two pp=1 configurations,
  each with about ``pp`` and ``2 pp`` microbatches.
- Nothing fits: a ``ShardingError`` names the smallest plan's memory per device, what
  dominates it, and the budget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from shardwise.api.creation import tensor as make_tensor
from shardwise.parallel import loss_parallel
from shardwise.planner.steps import fmt_bytes
from shardwise.planning.estimator import Estimate, fake_world, measure
from shardwise.planning.plans import ParallelPlan, divisors
from shardwise.planning.profiles import Profile, get_profile
from shardwise.planning.transformer import ModelConfig, Transformer, loss_fn
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.mappings import PlacementMapping
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import Replicated, Sharded

__all__ = ["Candidate", "PlanChoice", "auto_plan", "evaluate", "inputs", "train_step"]


@dataclass
class Candidate:
    """One plan as estimated: ``time_s``, ``peak`` and the estimate (at full depth when
    ``exact``; else extrapolated from shallower ones, ``estimate`` the deeper one)."""

    plan: ParallelPlan
    time_s: float
    peak: int
    memory: dict[str, int]
    comm: dict[str, int]
    estimate: Estimate
    exact: bool
    shares: dict[str, float] = field(default_factory=dict)


@dataclass
class PlanChoice:
    """What :func:`auto_plan` chose: ``plan`` (a :class:`ParallelPlan`: ``tp_plan()``
    for ``parallelize_module``, ``apply(model)``), its ``estimate`` (at full depth), and
    every ``candidate`` tried, fastest first."""

    plan: ParallelPlan
    estimate: Estimate
    candidates: list[Candidate]
    budget: int

    def table(self, top: int = 3) -> str:
        from shardwise.planning.report import side_by_side

        return side_by_side([c for c in self.candidates if c.peak <= self.budget][:top])


class _Model:
    """How to build the model (at a depth, where it is a config), its sizes, and how a
    step calls it."""

    def __init__(self, model: Any, seq: int | None) -> None:
        if isinstance(model, ModelConfig):
            self.config: ModelConfig | None = model
            self.layers, self.vocab, self.seq = model.layers, model.vocab, seq or model.seq
            self.heads = (model.heads, model.kv)
            return
        if not callable(model):
            raise ShardingError(f"auto_plan needs a ModelConfig or a function that builds the "
                                f"model. Got {model!r}; pass e.g. ModelConfig.llama3_8b().")
        self.config, self.make = None, model
        with fake_world():
            probe = model()
        c = getattr(probe, "config", None)
        self.layers = len(getattr(probe, "layers", ()))
        self.vocab = int(getattr(c, "vocab", None) or getattr(c, "vocab_size", None) or 0)
        self.seq = int(seq or getattr(c, "seq", None) or 0)
        heads = getattr(c, "heads", None) or 1
        self.heads = (heads, getattr(c, "kv_heads", 0) or heads)
        if not (self.vocab and self.seq):
            raise ShardingError(
                "auto_plan reads the vocabulary and context length from model.config "
                f"(.vocab and .seq); {type(probe).__name__} has none. Got config={c!r}; "
                "pass seq= and give the model a config, or pass a ModelConfig.")

    def build(self, layers: int | None = None) -> nn.Module:
        if self.config is not None:
            return Transformer(self.config.with_(layers=layers or self.config.layers,
                                                 seq=self.seq))
        return self.make()

    @property
    def splits(self) -> bool:
        """Whether a pipeline can cut it (the config decoder: children in order)."""
        return self.config is not None


def train_step(target: Any, opt: torch.optim.Optimizer, ids: Any, targets: Any) -> None:
    """One training step of what :meth:`ParallelPlan.apply` returned: forward (the
    pipeline's schedule, or the model's loss) and backward under ``loss_parallel``,
    then ``opt.step()`` and ``opt.zero_grad()``."""
    with loss_parallel():
        if hasattr(target, "pipe"):
            target.step(ids, target=targets, losses=[], return_outputs=False)
        else:
            target(ids, targets).backward()
    opt.step()
    opt.zero_grad()


def inputs(mesh: DeviceMesh, ids: torch.Tensor) -> Any:
    """``ids`` (the global batch) on ``mesh``: Sharded(0) over ``dp``, else Replicated."""
    placements = tuple(Sharded(0) if n == "dp" else Replicated() for n in mesh.axis_names)
    return make_tensor(ids, sharding=PlacementMapping(mesh, placements))


def evaluate(model: _Model, plan: ParallelPlan, batch: int, profile: Profile,
             layers: int | None = None, dtype: torch.dtype | None = None) -> Estimate:
    """The estimate of one training step of ``model`` laid out by ``plan``."""
    with fake_world():
        m = model.build(layers)
        if dtype is not None:
            m = m.to(dtype)
        target = plan.apply(m, loss_fn=loss_fn)
        if hasattr(target, "pipe"):
            params = list(target.pipe.parameters())
            first, last = target.pipe.stages[0].mesh, target.pipe.stages[-1].mesh
        else:
            params, first = list(m.parameters()), plan.mesh()
            last = first
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        empty = torch.empty((batch, model.seq), dtype=torch.int64)
        ids, tgt = inputs(first, empty), inputs(last, empty)
        return measure(train_step, (target, opt, ids, tgt), {}, mesh=plan.mesh(),
                       profile=profile)


def estimate_plan(model: Any, plan: ParallelPlan, *, batch: int,
                  profile: str | Profile | None = None, seq: int | None = None,
                  dtype: torch.dtype | None = None) -> Estimate:
    """The estimate of one training step of ``model`` laid out by ``plan`` (what
    :func:`auto_plan` ranks each candidate by), on fake tensors: no device is touched.

    Args:
        model: a ``ModelConfig``, or a function building the model (as ``auto_plan``).
        plan: the :class:`ParallelPlan` to price.
        batch: sequences per step (the global batch).
        profile: a preset name, a ``Profile`` or ``calibrate()``'s result.
        seq: the context length (default: the model's).
        dtype: the model's dtype (default: as built, float32).

    >>> from shardwise.planning import ModelConfig, ParallelPlan
    >>> gpt = ModelConfig.gpt(vocab=256, seq=32, dim=64, heads=4, layers=2)
    >>> est = estimate_plan(gpt, ParallelPlan(dp=2, tp=2), batch=4, profile="h100")
    >>> est.counts["all_reduce"] > 0 and est.time_s > 0
    True
    """
    return evaluate(_Model(model, seq), plan, batch, get_profile(profile), dtype=dtype)


def _summary(est: Estimate) -> dict[str, Any]:
    comm: dict[str, int] = {}
    for (axes, _, _), row in est.comm.items():
        comm[axes] = comm.get(axes, 0) + row.nbytes
    m = est.memory
    return {"time_s": est.time_s, "peak": m.peak, "comm": comm,
            "memory": {"params": m.params, "grads": m.grads, "optimizer": m.optimizer,
                       "activations": m.activations},
            "shares": est.timing.shares()}


def _extrapolate(a: dict[str, Any], b: dict[str, Any], k: float) -> dict[str, Any]:
    """``a + k * (b - a)`` for every number in the summaries (nested dicts too)."""
    out: dict[str, Any] = {}
    for key, va in a.items():
        vb = b[key]
        if isinstance(va, dict):
            out[key] = {n: va.get(n, 0) + k * (vb.get(n, 0) - va.get(n, 0))
                        for n in set(va) | set(vb)}
        else:
            out[key] = va + k * (vb - va)
    out["shares"] = b["shares"]
    return out


class _Search:
    def __init__(self, model: _Model, batch: int, profile: Profile, budget: int,
                 dtype: torch.dtype | None) -> None:
        self.model, self.batch, self.profile, self.budget = model, batch, profile, budget
        self.dtype = dtype
        self.tried: dict[tuple[ParallelPlan, bool], Candidate | None] = {}

    def candidate(self, plan: ParallelPlan, exact: bool = False) -> Candidate | None:
        key = (plan, exact)
        if key in self.tried:
            return self.tried[key]
        try:
            out = self._candidate(plan, exact)
        except (ShardingError, ValueError, RuntimeError):
            out = None  # (a plan the model's shapes refuse: heads over tp, say)
        self.tried[key] = out
        return out

    def _candidate(self, plan: ParallelPlan, exact: bool) -> Candidate:
        model, per = self.model, plan.pp
        if exact or model.config is None or model.layers <= 2 * per:
            est = evaluate(model, plan, self.batch, self.profile, dtype=self.dtype)
            return Candidate(plan, **_summary(est), estimate=est, exact=True)
        a = evaluate(model, plan, self.batch, self.profile, per, self.dtype)
        b = evaluate(model, plan, self.batch, self.profile, 2 * per, self.dtype)
        k = (model.layers - per) / per
        s = _extrapolate(_summary(a), _summary(b), k)
        s["peak"] = int(s["peak"])
        return Candidate(plan, **s, estimate=b, exact=False)

    def styles(self, plan: ParallelPlan) -> tuple[tuple[str, str], ...]:
        """The best style per module group, pair by pair, on ``plan``'s degrees."""
        groups, single = _groups(self.model)
        chosen: dict[str, str | None] = {}

        def with_(choice: dict[str, str | None]) -> ParallelPlan:
            styles = tuple((p, s) for g, s in choice.items() if s for p in g.split("|"))
            return replace(plan, styles=styles)

        def cost(choice: dict[str, str | None]) -> tuple[float, float]:
            # one block per stage is enough to compare styles on one configuration
            try:
                est = evaluate(self.model, with_(choice), self.batch, self.profile,
                               plan.pp if self.model.config is not None else None,
                               self.dtype)
            except (ShardingError, ValueError, RuntimeError):
                return float("inf"), float("inf")
            return est.time_s, est.memory.peak

        options: list[str | None] = [None, "colwise", "rowwise"]
        for i in range(0, len(groups) - 1, 2):
            pair = groups[i:i + 2]
            tried = {xy: cost({**chosen, pair[0]: xy[0], pair[1]: xy[1]})
                     for xy in ((x, y) for x in options for y in options)}
            best = _fastest_then_smallest(tried)
            chosen.update({pair[0]: best[0], pair[1]: best[1]})
        for name, style in single:
            if _fastest_then_smallest({style: cost({**chosen, name: style}),
                                       None: cost(chosen)}) == style:
                chosen[name] = style
        return with_(chosen).styles

    def run(self, devices: int, refine: int, max_pp: int, schedule: str) -> list[Candidate]:
        model, per_node = self.model, self.profile.devices_per_node
        tps = [t for t in divisors(devices) if t <= per_node
               and all(h % t == 0 for h in model.heads)]
        found: list[Candidate] = []
        styles: tuple[tuple[str, str], ...] = ()
        if max(tps) > 1:
            t = max(tps)
            styles = self.styles(ParallelPlan(dp=devices // t, tp=t))
        for t in tps:
            dp = devices // t
            if self.batch % dp or (t > 1 and not styles):
                continue  # (a tp axis nothing is sharded over only repeats the work)
            for fsdp in ([False, True] if dp > 1 else [False]):
                base = ParallelPlan(dp=dp, tp=t, fsdp=fsdp, styles=styles if t > 1 else ())
                found += self._with_recompute(base)
        fits = sorted((c for c in found if c.peak <= self.budget), key=lambda c: c.time_s)
        if model.splits:
            for c in fits[:2] or sorted(found, key=lambda c: c.peak)[:2]:
                found += self._pipelines(c.plan, devices, max_pp, schedule)
        ranked = sorted(found, key=lambda c: (c.peak > self.budget, c.time_s))
        exact = []
        for c in ranked[:refine]:
            full = c if c.exact else self.candidate(c.plan, exact=True)
            if full is not None:
                exact.append(full)
        rest = [c for c in ranked if all(c.plan != e.plan for e in exact)]
        return sorted(exact, key=lambda c: (c.peak > self.budget, c.time_s)) + rest

    def _with_recompute(self, plan: ParallelPlan) -> list[Candidate]:
        c = self.candidate(plan)
        if c is not None and c.peak <= self.budget:
            return [c]
        r = self.candidate(replace(plan, recompute=True))
        return [x for x in (c, r) if x is not None]

    def _pipelines(self, plan: ParallelPlan, devices: int, max_pp: int,
                   schedule: str) -> list[Candidate]:
        out = []
        for pp in divisors(devices):
            if pp == 1 or pp > max_pp or pp > self.model.layers or plan.size % pp:
                continue
            dp = plan.dp // pp if plan.dp % pp == 0 else 0
            if dp < 1 or self.batch % dp:
                continue
            local = self.batch // dp
            # the bubble shrinks with more microbatches, the per-microbatch costs (each
            # stage's ops, its sends) grow with them: both ends are tried
            ms = {max((k for k in divisors(local) if k <= n), default=1) for n in (pp, 2 * pp)}
            for m in sorted(ms):
                out += self._with_recompute(replace(
                    plan, pp=pp, dp=dp, microbatches=m, schedule=schedule,
                    fsdp=plan.fsdp and dp > 1))
        return out


#: styles whose times differ by less than this share are ties, decided by memory
TIE = 1e-3


def _fastest_then_smallest(costs: dict[Any, tuple[float, float]]) -> Any:
    """Of the keys within :data:`TIE` of the fastest ``(time, peak)``, the one with the
    least memory. Why: after column-parallel q/k/v an unsharded ``wo`` (or ``w2``)
    sums its partial output with the same all_reduce a row-parallel one does, so the
    two tie on time (to rounding), and the unsharded weight only costs memory; the
    first minimum left ``wo`` and ``w2`` unsharded in the Llama plans."""
    fastest = min(c[0] for c in costs.values())
    near = [k for k, c in costs.items() if c[0] <= fastest * (1 + TIE)]
    return min(near, key=lambda k: (costs[k][1], costs[k][0]))


def _groups(model: _Model) -> tuple[list[str], list[tuple[str, str]]]:
    """The linear modules of a block as groups of patterns (``|``-joined, modules that
    read one input), in call order; and the single choices: the head, the embedding."""
    with fake_world():
        m = model.build(1)
        calls: list[tuple[str, int]] = []
        hooks = []
        for name, mod in m.named_modules():
            if isinstance(mod, nn.Linear):
                hooks.append(mod.register_forward_hook(
                    lambda mod, args, out, name=name: calls.append((name, id(args[0])))))
        ids = torch.zeros((1, model.seq), dtype=torch.int64)
        m(ids, ids)
        for h in hooks:
            h.remove()
    by_input: dict[int, list[str]] = {}
    for name, key in calls:
        by_input.setdefault(key, []).append(name)
    pattern = re.compile(r"\.\d+\.")
    groups, single = [], []
    for names in by_input.values():
        pats = [pattern.sub(".*.", n) for n in names]
        if all(".*." in p for p in pats):
            groups.append("|".join(dict.fromkeys(pats)))
        else:
            single += [(p, "colwise_sharded") for p in pats]
    embeds = [n for n, mod in m.named_modules() if isinstance(mod, nn.Embedding)]
    single += [(pattern.sub(".*.", n), "rowwise") for n in embeds[:1]]
    return groups, single


def auto_plan(model: Any, *, devices: int, batch: int, memory_budget: int | None = None,
              profile: str | Profile | None = None, seq: int | None = None, refine: int = 3,
              max_pp: int = 8, schedule: str = "1F1B", dtype: torch.dtype | None = None
              ) -> PlanChoice:
    """Choose how to lay ``model`` out on ``devices`` devices: the fastest plan whose
    predicted peak memory per device fits ``memory_budget``.

    Args:
        model: a ``ModelConfig`` (the decoder it describes), or a function building the
            model (``forward(ids, targets)`` returns the loss; sizes in ``.config``).
        devices: how many devices.
        batch: sequences per step (the global batch).
        memory_budget: bytes per device (default: the profile's memory).
        profile: a preset name, a ``Profile`` or ``calibrate()``'s result.
        seq: the context length (default: the model's).
        refine: how many of the best are estimated at full depth before choosing.
        max_pp: the largest pipeline degree tried (pipelines need a ``ModelConfig``).
        schedule: the pipeline schedule (torch's name, as ``Schedule1F1B``'s).
        dtype: the model's dtype (default: as built, float32).

    Returns:
        a :class:`PlanChoice`: ``.plan`` (apply it: ``plan.apply(model)``, or take its
        ``tp_plan()`` for ``parallelize_module``), ``.estimate``, ``.candidates``.

    >>> from shardwise.planning import ModelConfig
    >>> gpt = ModelConfig.gpt(vocab=8192, seq=512, dim=1024, heads=8, layers=2)
    >>> choice = auto_plan(gpt, devices=4, batch=8, profile="h100")
    >>> print(choice.plan)                # it fits: data parallel (sharded) is fastest
    dp4(fsdp)
    >>> tp = next(c for c in choice.candidates if c.plan.tp > 1)
    >>> print(tp.plan)                              # Megatron: column then row parallel
    dp2(fsdp) x tp2 [wq colwise, wk colwise, wv colwise, wo rowwise, w1 colwise, \
w2 rowwise, head colwise_sharded]
    >>> tp.estimate.comm["tp", "forward", "all_reduce"].n   # two per block, two in the loss
    6
    """
    if devices < 1 or batch < 1:
        raise ShardingError(f"auto_plan needs devices >= 1 and batch >= 1. Got devices="
                            f"{devices}, batch={batch}.")
    prof = get_profile(profile)
    budget = prof.memory if memory_budget is None else int(memory_budget)
    m = _Model(model, seq)
    search = _Search(m, batch, prof, budget, dtype)
    ranked = search.run(devices, refine, max_pp, schedule)
    if not ranked:
        raise ShardingError(
            f"auto_plan found no plan for {devices} devices and batch {batch}: every "
            "degree split refused the model's shapes. Got heads "
            f"{m.heads}; use a batch divisible by the data-parallel degree.")
    best = ranked[0]
    if best.peak > budget:
        small = min(ranked, key=lambda c: c.peak)
        part, size = max(small.memory.items(), key=lambda kv: kv[1])
        raise ShardingError(
            f"Cannot fit the model on {devices} devices in {fmt_bytes(budget)} per device: "
            f"the smallest plan ({small.plan}) needs {fmt_bytes(small.peak)}, mostly "
            f"{part} ({fmt_bytes(size)}). Got memory_budget={budget}; add devices, cut the "
            "batch or sequence, or raise the budget.")
    if not best.exact:
        full = search.candidate(best.plan, exact=True)
        best = full or best
    return PlanChoice(best.plan, best.estimate, ranked, budget)

