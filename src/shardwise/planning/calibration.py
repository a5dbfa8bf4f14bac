"""``shardwise.calibrate``: a :class:`Profile` of the machine at hand, measured on Gloo
processes: the flop rate, the memory bandwidth, the per-op overheads, and an alpha-beta
link per mesh axis group.

Invariants:
- Every rank measures at once, as in training (ranks sharing cores share them here
  too); a time is the slowest rank's, the median over repeats.
- Collectives run through shardwise's own runtime (its agreement included) and are
  sized by ``CommCounter``'s bytes, so the fitted ``beta`` prices the bytes the estimate
  counts and ``alpha`` (per ring hop) everything else a collective costs.
- Links are fitted per group (size, stride) of the meshes ``(n,)`` and, for an even
  ``n`` above 2, ``(2, n/2)``: the groups a plan on ``n`` devices runs collectives on.
  A pipeline stage's send (``Profile.p2p``) is priced on the median of them (by beta).
- The processes are spawned here (torch.multiprocessing, Gloo on 127.0.0.1, a free
  port); nothing is left running: a rank that fails or outlives the limit is killed.
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import socket
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from shardwise.planning.profiles import Link, Profile
from shardwise.sharding.errors import ShardingError

__all__ = ["calibrate", "measurements", "profile_of", "spawn"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, body: Callable[[Any], Any], args: Any,
            out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from shardwise.api import distributed as sd

    try:
        sd.initialize("gloo", rank=rank, world_size=world, master_addr="127.0.0.1",
                      master_port=port, timeout_s=120)
        res = body(args)
        out.put((rank, True, res if rank == 0 else None))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            sd.shutdown()


def spawn(body: Callable[[Any], Any], args: Any, world: int, limit_s: float = 600.0) -> Any:
    """Rank 0's ``body(args)`` after running it on ``world`` Gloo processes (spawned;
    ``body`` a module-level function). A rank's failure raises with its traceback."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [ctx.Process(target=_worker, args=(r, world, port, body, args, out),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + limit_s
    try:
        while len(got) < world and time.monotonic() < deadline:
            with contextlib.suppress(queue_mod.Empty):
                rank, ok, res = out.get(timeout=0.5)
                got[rank] = (ok, res)
                if not ok:
                    break
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in
                    (None, 0)]
            if dead:
                got[dead[0]] = (False, f"rank {dead[0]} exited with {procs[dead[0]].exitcode}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == world else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failed = sorted((r, res) for r, (ok, res) in got.items() if not ok)
    if failed:
        raise ShardingError(f"calibrate: rank {failed[0][0]} failed:\n{failed[0][1]}")
    if len(got) < world:
        raise ShardingError(f"calibrate: ranks {sorted(set(range(world)) - set(got))} did not "
                            f"finish within {limit_s:.0f} s (killed).")
    return got[0][1]


def slowest(fn: Callable[[], Any], repeat: int, inner: int = 1) -> float:
    """Seconds per call of ``fn`` on the slowest rank: barrier, ``inner`` calls timed,
    the max over ranks, the median over ``repeat`` (one warm-up first)."""
    import torch
    import torch.distributed as dist

    fn()
    times = torch.empty(repeat, dtype=torch.float64)
    for i in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times[i] = (time.perf_counter() - t0) / inner
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return float(statistics.median(times.tolist()))


def _compute(repeat: int) -> dict[str, float]:
    import torch

    from shardwise.api.creation import tensor
    from shardwise.sharding.mappings import PlacementMapping
    from shardwise.sharding.mesh import DeviceMesh
    from shardwise.sharding.placements import Sharded

    # each timing spans many scheduler slices (tens of ms), so ranks that share cores
    # are measured sharing them, as they compute in a step
    n = 384
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n ** 3 / slowest(lambda: a @ b, repeat, 40)
    big = torch.randn(1 << 22)
    bandwidth = 3 * big.numel() * 4 / slowest(lambda: big + big, repeat, 8)
    one = torch.ones(1)
    kernel = slowest(lambda: one + one, repeat, 200)
    world = torch.distributed.get_world_size()
    mesh = DeviceMesh.cpu(world, "dp")
    x = tensor(torch.ones(world, 4), sharding=PlacementMapping(mesh, (Sharded(0),)))
    add = max(0.0, slowest(lambda: x + x, repeat, 100) - kernel)
    return {"flops": flops, "bandwidth": bandwidth, "kernel": kernel,
            "op": max(add, _op_overhead(repeat)), **_kinds(repeat)}


def _kinds(repeat: int) -> dict[str, float]:
    """The rates of the op kinds the matmul rate and the bandwidth misprice on a CPU
    (``estimator.op_record``'s kinds): causal attention forward + backward, in the
    estimate's flops (4 + 10 per b*h*s*s*d, halved for causal), and a transcendental
    elementwise op (gelu), in elements. Why: a GPT step's flash attention measured 3.6x
    below the matmul rate and gelu 3x above its bytes' time."""
    import torch
    import torch.nn.functional as F

    b, h, t, d = 4, 8, 128, 32
    q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))

    def attention() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    attn = 14 * b * h * t * t * d * 0.5 / slowest(attention, repeat, 5)
    x = torch.randn(1 << 19)
    gelu = x.numel() / slowest(lambda: F.gelu(x), repeat, 20)
    return {"attention": attn, "transcendental": gelu}


def _op_overhead(repeat: int) -> float:
    """A shardwise op's own seconds, its backward's included, in a decoder's training
    step (views, linears, norms, attention; a width-8 model, so nearly all of it is
    overhead): forward and backward on Tensors less plain torch's on one device's rows,
    per torch call on Tensors in the forward (the estimate's frames). The weights are
    frozen, so no gradient is reduced (no collective is timed). Why not ``x + x``'s:
    one cached elementwise op measured 8 us a call where the decoder's calls cost about
    20x that (4 ranks sharing 2 cores)."""
    import torch
    import torch.nn as nn
    from torch.utils._pytree import tree_flatten

    from shardwise.api.creation import tensor
    from shardwise.planning.plans import ParallelPlan
    from shardwise.planning.transformer import ModelConfig, Transformer
    from shardwise.sharding.mappings import PlacementMapping
    from shardwise.sharding.placements import Sharded
    from shardwise.tensors.tensor import Tensor

    class Calls(torch.overrides.TorchFunctionMode):
        """Counts the torch calls on shardwise Tensors (the estimate's frames)."""

        n = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if any(isinstance(a, Tensor) for a in tree_flatten((args, kwargs or {}))[0]):
                self.n += 1
            return func(*args, **(kwargs or {}))

    world = torch.distributed.get_world_size()
    config = ModelConfig.gpt(vocab=16, seq=8, dim=8, heads=2, layers=2)
    plan = ParallelPlan(dp=world)

    def body(model: Transformer) -> nn.Module:
        model.requires_grad_(False)
        return nn.Sequential(*model.layers, model.norm, model.head)

    torch.manual_seed(0)
    ref = body(Transformer(config))
    torch.manual_seed(0)
    planned = Transformer(config)
    plan.apply(planned)
    model = body(planned)
    h = torch.ones((world, config.seq, config.dim))
    x = tensor(h, sharding=PlacementMapping(plan.mesh(), (Sharded(0),))).requires_grad_()
    g = tensor(torch.ones(world, config.seq, config.vocab),
               sharding=PlacementMapping(plan.mesh(), (Sharded(0),)))
    h1, g1 = h[:1].clone().requires_grad_(), torch.ones(1, config.seq, config.vocab)
    with Calls() as calls:
        model(x)
    spent = (slowest(lambda: model(x).backward(g), repeat, 5)
             - slowest(lambda: ref(h1).backward(g1), repeat, 5))
    return max(0.0, spent / max(calls.n, 1))


# each link point's timed calls in one round of measurements: one call's time on
# ranks sharing cores moved 2-5x between rounds
LINK_SAMPLES = 5


def _links(repeat: int) -> dict[str, list[float]]:
    import torch

    from shardwise.api.communication import all_gather
    from shardwise.api.creation import tensor
    from shardwise.api.reducing import all_reduce
    from shardwise.debug.comm import CommCounter
    from shardwise.sharding.mappings import PlacementMapping
    from shardwise.sharding.mesh import DeviceMesh
    from shardwise.sharding.placements import Replicated, Sharded

    world = torch.distributed.get_world_size()
    meshes = [DeviceMesh.cpu(world, "x")]
    if world > 2 and world % 2 == 0:
        meshes.append(DeviceMesh.cpu((2, world // 2), ("a", "b")))
    points: dict[str, list[float]] = {}
    for mesh in meshes:
        for axis in range(mesh.ndim):
            size = mesh.mesh_shape[axis]
            stride = int(np.prod(mesh.mesh_shape[axis + 1:]))
            for numel in (256, 1 << 14, 1 << 18):
                place = tuple(Sharded(0) if a == axis else Replicated()
                              for a in range(mesh.ndim))
                rows = numel // size * size
                t = tensor(torch.ones(rows), sharding=PlacementMapping(mesh, place))
                for kind, call in (
                        ("all_gather", lambda t=t: all_gather(t)),
                        ("all_reduce", lambda t=t, a=axis, m=mesh: all_reduce(
                            t, reduce_axes=[m.axis_names[a]]))):
                    with CommCounter() as cc:
                        call()
                    nbytes = sum(e.nbytes for e in cc.events if e.kind == kind)
                    seconds = slowest(call, repeat * LINK_SAMPLES)
                    hops = 2 * (size - 1) if kind == "all_reduce" else size - 1
                    points.setdefault(f"{size},{stride}", []).extend(
                        [float(hops), float(nbytes), seconds])
    return points


def _measure(args: dict[str, Any]) -> dict[str, Any]:
    return measurements(args["repeat"])


def measurements(repeat: int = 1) -> dict[str, Any]:
    """One round of what :func:`calibrate` measures, called on every rank of a Gloo
    world at once (the same on every rank: each time is the slowest rank's). Rounds
    taken between other work (a benchmark's steps) share its load; :func:`profile_of`
    makes the profile of their medians.

    >>> rounds = [measurements() for _ in range(3)]     # doctest: +SKIP
    >>> profile_of(rounds, devices=4).op_overhead > 0   # doctest: +SKIP
    True
    """
    return {"compute": _compute(repeat), "links": _links(repeat)}


def profile_of(rounds: list[dict[str, Any]], devices: int) -> Profile:
    """The calibrated :class:`Profile` of :func:`measurements` rounds on ``devices``
    ranks: each figure's median over the rounds, and the links fitted to the medians.

    >>> one = {"compute": {"flops": 1e11, "bandwidth": 1e10, "kernel": 2e-6,
    ...                    "op": 1e-4}, "links": {"2,1": [1, 0, 1e-3, 1, 1e6, 2e-3]}}
    >>> p = profile_of([one, one], devices=2)
    >>> p.groups[(2, 1)], p.op_overhead
    (Link(alpha=0.001, beta=1e-09), 0.0001)
    """
    if not rounds:
        raise ShardingError("profile_of needs at least one round of measurements. Got "
                            "none; pass [measurements(), ...].")
    c = {k: statistics.median(r["compute"][k] for r in rounds) for k in rounds[0]["compute"]}
    groups: dict[tuple[int, int], Link] = {}
    for key, first in rounds[0]["links"].items():
        points = list(first)
        for i in range(2, len(points), 3):  # [hops, bytes, seconds] per point
            points[i] = statistics.median(r["links"][key][i] for r in rounds)
        size, stride = (int(v) for v in key.split(","))
        groups[(size, stride)] = fit(points)
    by_beta = sorted(groups.values(), key=lambda lk: lk.beta)
    slow = by_beta[-1]
    # a stage's send: one hop, while the other ranks compute on the shared cores, as a
    # collective's hop; the median group, so that one noisy fit moves no pipeline plan
    p2p = by_beta[(len(by_beta) - 1) // 2]
    rates = {"float32": c["flops"], "bfloat16": c["flops"] / 4,
             **{k: c[k] for k in ("attention", "transcendental") if k in c}}
    return Profile(
        "calibrated", rates,
        memory_bandwidth=c["bandwidth"], memory=_memory() // devices,
        intra=slow, inter=slow, devices_per_node=devices, op_overhead=c["op"],
        kernel_overhead=c["kernel"], overlap=0.0, groups=groups, host_bound=True,
        cores=_cores(), p2p=p2p)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fit(points: list[float]) -> Link:
    """The alpha-beta link of flat ``[hops, bytes, seconds, ...]`` measurements (least
    squares, both terms at least 0).

    >>> fit([1, 0, 2e-5, 1, 1e6, 1.002e-3, 3, 1e6, 1.042e-3])
    Link(alpha=2e-05, beta=9.82e-10)
    """
    rows = np.array(points, dtype=np.float64).reshape(-1, 3)
    a = rows[:, :2]
    t = rows[:, 2]
    (alpha, beta), *_ = np.linalg.lstsq(a, t, rcond=None)
    if beta < 0:
        alpha, beta = float(np.mean(t / a[:, 0])), 0.0
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(a[:, 1] * t) / max(np.sum(a[:, 1] ** 2), 1e-30))
    return Link(float(f"{alpha:.3g}"), float(f"{beta:.3g}"))


def calibrate(devices: int = 4, *, repeat: int = 5, limit_s: float = 600.0) -> Profile:
    """Measure this machine on ``devices`` Gloo processes: the profile ``estimate``
    and ``auto_plan`` take for a prediction of a step here.

    Args:
        devices: how many processes (ranks) to measure with.
        repeat: timed repeats of each measurement (the median is kept).
        limit_s: the wall-clock limit for the whole measurement.

    Returns:
        a :class:`Profile` named ``"calibrated"``: ``flops["float32"]`` (a matmul's
        rate per rank with every rank busy), ``memory_bandwidth``, ``kernel_overhead``
        (a torch op), ``op_overhead`` (a shardwise op's own), ``groups`` (a measured
        link per group size and stride), no overlap (Gloo's collectives block).

    >>> profile = calibrate(2, repeat=2)                    # doctest: +SKIP
    >>> profile.flops["float32"] > 0 and (2, 1) in profile.groups   # doctest: +SKIP
    True
    """
    if devices < 2:
        raise ShardingError(f"calibrate needs at least 2 devices to measure links. Got "
                            f"devices={devices}.")
    return profile_of([spawn(_measure, {"repeat": repeat}, devices, limit_s)], devices)


def _memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 16 << 30
