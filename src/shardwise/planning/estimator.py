"""``shardwise.estimate``: one training step on fake tensors (shapes, no data) on a mesh
as large as asked, and what it costs the most loaded device: memory, collectives, time.

Invariants:
- The step runs shardwise's own dispatch (the ops' rules, the planner, the runtime's
  counting) on torch fake tensors: the same decisions and collectives as a real step on
  the simulated mesh, counted by ``CommCounter``, with no data and no allocation.
- The simulated mesh holds each value whole (one fake buffer), so the program runs once
  whatever the mesh's size: devices enter only through layouts (each device's block
  bytes, the share of an op each does), never as a loop over devices with equal blocks.
- Inputs are never mutated: modules, optimizers and tensors among the arguments are
  copied as fake (a meta-device module is made fake on the mesh's device), and
  ``DistributedTensorType``/``TensorType`` arguments become fake Tensors of that type.
- Before the measured step each optimizer steps once on zero gradients (its state then
  exists, as in training; or ``warmup`` unmeasured steps run), then the step runs once
  measured: memory by ``MemoryTracker``'s ledger, collectives by ``CommCounter``,
  ops by the ledger's op records; :meth:`Estimate.retime` re-times it on another profile.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils.flop_counter import flop_registry

import shardwise.ops  # noqa: F401  (installs the Tensor operators)
from shardwise.api.creation import tensor as make_tensor
from shardwise.debug.comm import CommCounter
from shardwise.debug.ledger import Context, Ledger, block_bytes
from shardwise.debug.memory import MemoryTracker
from shardwise.pipelining.executor import PipelineSchedule
from shardwise.planning.profiles import Profile, get_profile
from shardwise.planning.timing import CommRecord, OpRecord, Pipeline, Timing, time_step
from shardwise.sharding.errors import ShardingError, ShardingTypeError
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.types import BufferType, DistributedTensorType, TensorType
from shardwise.tensors.tensor import Tensor

__all__ = ["CommRow", "Estimate", "Memory", "estimate", "fake_world", "measure"]


@dataclass(frozen=True)
class Memory:
    """Bytes on the most loaded device (``device``): ``params``, ``grads`` (all of them
    at once), ``optimizer`` state, ``activations`` (the most held at once: saved
    activations and temporaries) and ``peak`` (everything at the step's peak)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    device: Any = None


@dataclass(frozen=True)
class CommRow:
    """Collectives of one kind, phase and mesh axes: how many, bytes per device."""

    n: int
    nbytes: int


@dataclass
class Estimate:
    """What :func:`estimate` predicts for one step (see its doc)."""

    memory: Memory
    per_device: dict[Any, int]
    counts: Counter[str]
    bytes: Counter[str]
    backward_counts: Counter[str]
    backward_bytes: Counter[str]
    comm: dict[tuple[str, str, str], CommRow]
    timing: Timing
    profile: Profile
    ops: list[OpRecord] = field(repr=False, default_factory=list)
    comms: list[CommRecord] = field(repr=False, default_factory=list)
    pipeline: Any = field(repr=False, default=None)

    @property
    def time_s(self) -> float:
        """Predicted seconds per step (:attr:`timing` has the breakdown)."""
        return self.timing.step

    def retime(self, profile: str | Profile) -> Estimate:
        """This estimate's time on another profile (memory and collectives are the
        same; see :func:`estimate`'s example)."""
        prof = get_profile(profile)
        out = copy.copy(self)
        out.profile = prof
        out.timing = time_step(self.ops, self.comms, prof, self.pipeline)
        return out

    def __str__(self) -> str:
        from shardwise.planning.report import describe

        return describe(self)


# --- the op records ---------------------------------------------------------------------
def _attention_flops(q: torch.Tensor, k: torch.Tensor, causal: bool, factor: int) -> float:
    b, h, s, d = q.shape[0], q.shape[1], q.shape[-2], q.shape[-1]
    return factor * b * h * s * k.shape[-2] * d * (0.5 if causal else 1.0)


def _flops(func: Any, args: Any, kwargs: Any, out: Any) -> float:
    packet = getattr(func, "_overloadpacket", None)
    count = flop_registry.get(packet)
    if count is not None:
        return float(count(*args, **(kwargs or {}), out_val=out))
    name = str(packet)
    if name.endswith("_scaled_dot_product_flash_attention_for_cpu"):
        return _attention_flops(args[0], args[1], bool((kwargs or {}).get("is_causal")), 4)
    if name.endswith("_scaled_dot_product_flash_attention_for_cpu_backward"):
        causal = bool((kwargs or {}).get("is_causal", args[7] if len(args) > 7 else False))
        return _attention_flops(args[1], args[2], causal, 10)
    return 0.0


def _nbytes(values: Any) -> int:
    total = 0
    for v in torch.utils._pytree.tree_flatten(values)[0]:
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


#: elementwise ops whose time is their transcendental math, not their bytes: priced as
#: one "flop" per output element at the profile's ``"transcendental"`` rate
TRANSCENDENTAL = frozenset({"gelu", "gelu_backward", "silu", "silu_backward"})


def op_record(func: Any, args: Any, kwargs: Any, out: Any
              ) -> tuple[float, int, str, str] | None:
    """(flops, bytes read and written, dtype, kind) of one aten op on whole values; None
    for views and ops that move nothing. ``kind`` names a rate of its own where the
    profile has one (``"attention"``, ``"transcendental"``), else it is ``""``."""
    if getattr(func, "is_view", False) or func.namespace == "prim":
        return None
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    dtype = str(first.dtype).removeprefix("torch.") if first is not None else "float32"
    name = str(getattr(func, "_overloadpacket", func)).rsplit(".", 1)[-1]
    if name.startswith("_scaled_dot_product"):
        return _flops(func, args, kwargs, out), _nbytes((args, out)), dtype, "attention"
    if name in TRANSCENDENTAL:
        n = sum(o.numel() for o in torch.utils._pytree.tree_flatten(out)[0]
                if isinstance(o, torch.Tensor))
        return float(n), _nbytes((args, out)), dtype, "transcendental"
    return _flops(func, args, kwargs, out), _nbytes((args, out)), dtype, ""


class _Recorder:
    """The estimate's op sink: each frame's and backward node's ops, as the busiest
    device of its stage runs them."""

    def __init__(self, stage_of: Callable[[DeviceMesh | None], int]) -> None:
        self.stage_of = stage_of
        self.ops: list[OpRecord] = []
        self.optimizer = False
        self.spans: list[tuple[int, int]] = []  # CommCounter events of optimizer steps

    def phase(self, backward: bool) -> str:
        return "optimizer" if self.optimizer else "backward" if backward else "forward"

    def __call__(self, ctx: Context, ops: list[Any], backward: bool) -> None:
        stage, phase, w = self.stage_of(ctx.mesh), self.phase(backward), ctx.work
        if not backward and ctx.mesh is not None:  # a shardwise op's own cost (views too)
            self.ops.append(OpRecord(stage, phase, 0.0, 0.0, "", True))
        for flops, nbytes, dtype, kind in ops:
            self.ops.append(OpRecord(stage, phase, flops * w, nbytes * w, dtype, kind=kind))


# --- fake copies of the arguments -------------------------------------------------------
def _to_fake(x: Any) -> Any:
    if isinstance(x, DistributedTensorType) and not isinstance(x, BufferType):
        return make_tensor(torch.empty(tuple(x.shape), dtype=_dtype(x.dtype)),
                           sharding=x.layout)
    if isinstance(x, TensorType) and not isinstance(x, BufferType):
        return torch.empty(tuple(x.shape), dtype=_dtype(x.dtype))
    return x


def _dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype), None)
    if not isinstance(found, torch.dtype):
        raise ShardingTypeError(f"Cannot estimate with dtype {dtype!r}: not a torch dtype. "
                                "Use e.g. torch.float32 or 'float32'.")
    return found


def _walk(x: Any) -> Iterator[Any]:
    todo = [x]
    while todo:
        v = todo.pop()
        if isinstance(v, (list, tuple)):
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.values())
        else:
            yield v


def _map(fn: Callable[[Any], Any], x: Any) -> Any:
    if isinstance(x, list):
        return [_map(fn, v) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_map(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _is_meta(t: torch.Tensor) -> bool:
    if isinstance(t, Tensor):
        first = t.held.first()
        return first is not None and first.is_meta
    return t.is_meta


def _fake_of(t: torch.Tensor) -> torch.Tensor:
    """A fake value like meta ``t``: a shardwise Tensor held whole in ``t``'s layout
    (one buffer, whatever the mesh's size), or a plain fake tensor."""
    if isinstance(t, Tensor):
        return make_tensor(torch.empty(tuple(t.shape), dtype=t.dtype), sharding=t.dist_layout)
    return torch.empty(tuple(t.shape), dtype=t.dtype)


def _fake_memo(values: Any) -> dict[int, Any]:
    """A deepcopy memo that copies each meta-device parameter and buffer of the modules
    among ``values`` as a fake value held whole (no meta blocks are cloned)."""
    memo: dict[int, Any] = {}
    for root in _walk(values):
        if isinstance(root, nn.Module):
            for t in [*root.parameters(), *root.buffers()]:
                if id(t) not in memo and _is_meta(t):
                    new = _fake_of(t)
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    memo[id(t)] = new
    return memo


@contextlib.contextmanager
def fake_world() -> Iterator[FakeTensorMode]:
    """Fake tensors for a step: torch's fake mode, with its data-pointer warnings off.

    >>> with fake_world():
    ...     x = torch.ones(2**20, 2**20)       # 4 TiB, never allocated
    >>> type(x).__name__
    'FakeTensor'
    """
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")
        yield mode


def _run(step_fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    try:
        return step_fn(*args, **kwargs)
    except (DataDependentOutputException, NotImplementedError) as err:
        name = getattr(step_fn, "__name__", repr(step_fn))
        raise ShardingError(
            f"Cannot estimate {name}: it reads a value ({type(err).__name__}: {err}), and "
            "the estimate runs on fake tensors without data. Got a step that reads data; "
            "return the loss instead of reading it (float(loss), .item(), print).") from err


def _data_axes(mesh: DeviceMesh, data_axes: Any) -> frozenset[str]:
    if data_axes is None:
        return frozenset(n for n in mesh.axis_names if "dp" in n or "data" in n)
    names = frozenset([data_axes] if isinstance(data_axes, str) else data_axes)
    unknown = sorted(names - set(mesh.axis_names))
    if unknown:
        raise ShardingError(f"Cannot estimate with data_axes {unknown}: {mesh!r} has axes "
                            f"{list(mesh.axis_names)}. Name axes of the mesh.")
    return names


def estimate(step_fn: Callable[..., Any], *args: Any, mesh: DeviceMesh,
             profile: str | Profile | None = None, warmup: int | str = "optimizer",
             data_axes: Any = None, **kwargs: Any) -> Estimate:
    """Predict one training step of ``step_fn(*args, **kwargs)`` on ``mesh``: memory,
    collectives and time on the most loaded device, without data.

    Args:
        step_fn: one training step (forward, backward, optimizer step); it must not
            read values (the step runs on fake tensors).
        *args, **kwargs: its arguments: modules, optimizers and pipeline schedules
            (copied, never changed; meta-device modules are fine), tensors, and
            ``DistributedTensorType``s standing for inputs of that type. With a
            ``PipelineSchedule`` among them the time is its table's, simulated with
            each stage's measured costs (``pipelining.simulate``).
        mesh: the mesh the step runs on (any size: the program runs once).
        profile: a preset name (``"h100"``, ``"a100"``), a ``Profile`` or
            ``shardwise.calibrate()``'s result (default ``"h100"``).
        warmup: ``"optimizer"`` (default): each optimizer first steps once on zero
            gradients, so its state exists as in training; or a number of unmeasured
            runs of ``step_fn`` first.
        data_axes: mesh axes whose collectives may hide behind compute (default: the
            axes named like ``dp``/``data``).

    Returns:
        An :class:`Estimate`: ``memory`` (``params``, ``grads``, ``optimizer``,
        ``activations``, ``peak``), ``counts``/``bytes`` (CommCounter's, forward) and
        ``backward_counts``/``backward_bytes``, ``comm`` by (mesh axes, phase, kind),
        ``time_s`` with ``timing`` (compute, exposed communication, bubble).

    A data-parallel linear layer on 4 devices, trained with SGD::

        >>> from shardwise.parallel import parallelize_module
        >>> mesh = DeviceMesh.cpu(4, "dp")
        >>> model = parallelize_module(nn.Linear(64, 64), mesh, {})     # replicated
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> x = DistributedTensorType(torch.float32, (32, 64), mesh, [Sharded(0)])
        >>> def train_step(model, opt, x):
        ...     model(x).square().mean().backward()
        ...     opt.step()
        ...     opt.zero_grad()
        >>> est = estimate(train_step, model, opt, x, mesh=mesh)
        >>> est.memory.params, est.backward_counts    # every weight, and its gradient's sum
        (16640, Counter({'all_reduce': 2}))
        >>> est.comm["dp", "backward", "all_reduce"]
        CommRow(n=2, nbytes=24960)
        >>> est.retime("a100").time_s > est.time_s     # an A100 is slower than an H100
        True
    """
    if not isinstance(mesh, DeviceMesh):
        raise ShardingTypeError(f"estimate needs mesh=DeviceMesh(...). Got {mesh!r} "
                                f"({type(mesh).__name__}); build one with DeviceMesh.cpu(...).")
    if not callable(step_fn):
        raise ShardingTypeError(f"estimate needs a step function. Got {step_fn!r}.")
    prof = get_profile(profile)
    _data_axes(mesh, data_axes)
    with fake_world():
        fargs, fkwargs = copy.deepcopy((args, kwargs), _fake_memo((args, kwargs)))
        fargs, fkwargs = _map(_to_fake, fargs), _map(_to_fake, fkwargs)
        return measure(step_fn, fargs, fkwargs, mesh=mesh, profile=prof, warmup=warmup,
                       data_axes=data_axes)


def measure(step_fn: Callable[..., Any], args: Any, kwargs: Any, *, mesh: DeviceMesh,
            profile: str | Profile | None = None, warmup: int | str = "optimizer",
            data_axes: Any = None) -> Estimate:
    """:func:`estimate` on arguments that are ours to change: fake values made inside
    :func:`fake_world` (``auto_plan`` builds its candidates there)."""
    prof = get_profile(profile)
    data = _data_axes(mesh, data_axes)
    ranks: dict[DeviceMesh, int] = {}

    def stage_of(m_: DeviceMesh | None) -> int:
        return ranks.get(m_, 0) if m_ is not None else 0

    recorder = _Recorder(stage_of)
    ledger = Ledger(op_record=op_record, op_sink=recorder)
    optimizers = [o for o in _walk((args, kwargs)) if isinstance(o, torch.optim.Optimizer)]
    sched = next((x for x in _walk((args, kwargs)) if isinstance(x, PipelineSchedule)), None)
    p2p: list[int] = []
    hooks = []
    if sched is not None:
        for st in sched.pipe.stages:
            ranks.setdefault(st.mesh, len(ranks))
            hooks.append(st.module.register_forward_hook(
                functools.partial(_output_bytes, p2p)))
    if warmup == "optimizer":
        _prime(optimizers)
    else:
        for _ in range(int(warmup)):
            _run(step_fn, args, kwargs)
    counter = CommCounter()
    undo = _watch_optimizers(optimizers, recorder, counter)
    try:
        state = (args, kwargs, [] if sched is None else [st.module for st in sched.pipe.stages])
        with MemoryTracker(state, ledger=ledger) as tracker, counter:
            _run(step_fn, args, kwargs)
    finally:
        undo()
        for h in hooks:
            h.remove()
    comms: list[CommRecord] = []
    rows: dict[tuple[str, str, str], list[int]] = {}
    for i, e in enumerate(counter.events):
        in_step = any(a <= i < b for a, b in recorder.spans)
        c = _comm_record(e, stage_of, data, "optimizer" if in_step else e.phase)
        if c is None:
            continue
        comms.append(c)
        row = rows.setdefault((c.names, e.phase, e.kind), [0, 0])
        row[0] += 1
        row[1] += e.nbytes
    pipeline = None if sched is None else Pipeline(
        sched.actions, sched.n_microbatches, max(p2p, default=0),
        tuple(ranks[st.mesh] for st in sched.pipe.stages))
    timing = time_step(recorder.ops, comms, prof, pipeline)
    most = tracker.most
    memory = Memory(most["params"], most["grads"], most["optimizer"], most["activations"],
                    tracker.peak, tracker.device)
    return Estimate(memory, tracker.per_device, Counter(counter.counts),
                    Counter(counter.bytes), Counter(counter.backward_counts),
                    Counter(counter.backward_bytes),
                    {k: CommRow(*v) for k, v in rows.items()}, timing, prof,
                    recorder.ops, comms, pipeline)


def _prime(optimizers: list[Any]) -> None:
    """Step each optimizer once on zero gradients: its state is made as in training."""
    for opt in optimizers:
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _output_bytes(sizes: list[int], module: nn.Module, args: Any, out: Any) -> None:
    """A stage's forward hook: the bytes of its output's largest block (what it sends)."""
    total = 0
    for t in _walk(out):
        if isinstance(t, Tensor):
            per = block_bytes(t.dist_layout, tuple(t.shape), t.dtype.itemsize)
            total += int(per if isinstance(per, int) else per.max())
        elif isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    sizes.append(total)


def _watch_optimizers(optimizers: list[Any], recorder: _Recorder,
                      counter: CommCounter) -> Callable[[], None]:
    """Mark the ops and collectives of every ``opt.step()`` as the optimizer's (the
    optimizers are our copies)."""
    for opt in optimizers:
        real = opt.step

        def step(*a: Any, _real: Any = real, **k: Any) -> Any:
            recorder.optimizer = True
            start = len(counter.events)
            try:
                return _real(*a, **k)
            finally:
                recorder.optimizer = False
                recorder.spans.append((start, len(counter.events)))
        opt.step = step

    def undo() -> None:
        for opt in optimizers:
            opt.__dict__.pop("step", None)
    return undo


def _comm_record(event: Any, stage_of: Callable[[Any], int], data: frozenset[str],
                 phase: str) -> CommRecord | None:
    step = event.step
    if step is None:
        return None
    mesh = step.before.mesh
    names = step.axis_names
    group = 1
    for a in step.axes:
        group *= mesh.mesh_shape[a]
    return CommRecord(str(step.kind), group, event.nbytes, mesh, tuple(step.axes),
                      ",".join(names), phase, stage_of(mesh),
                      bool(names) and all(n in data for n in names))
