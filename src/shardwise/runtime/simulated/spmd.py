"""shard_map on the simulated runtime: one thread per device, collectives by rendezvous.

Invariants:
- ``fn`` runs once per mesh device, each in its own thread (device 0 on the
  caller's, the others on a pool of reused daemon threads), under the caller's
  grad mode, inference mode, autocast and contextvars; while torch.compile traces,
  also under its dispatch modes and keys, one device at a time (a baton, let go only
  while a device waits at a rendezvous: the modes' state is shared by the threads).
- Every collective is one rendezvous of *all* devices: each deposits its local
  value, meets the others at one ``threading.Barrier`` (whose action checks, once,
  that every device called the same op with the same arguments and compatible
  shapes), then computes its own result from its group's values. Deposits
  alternate between two buffers, so one barrier per collective is enough: a
  device can only overwrite a buffer after everyone has passed the next barrier.
- Results are computed by the in-process collectives (``runtime/collectives.py``, shared
  with the backend and the graph ops): differentiable torch ops into fresh tensors, so
  the one autograd graph spanning the threads gives the exact gradient of the
  global computation.
- Returning from ``fn`` is a rendezvous too, so a device that skips a collective
  is reported at once. Barriers time out; an exception in any device aborts the
  barrier, and the caller re-raises the first real exception. Nothing hangs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.runtime import SpmdOutputs, collectives, spmd
from shardwise.runtime import observe as comm
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp

__all__ = ["SimEnv", "run", "run_spmd", "spmd_outputs"]


@functools.lru_cache(maxsize=1024)
def _groups(mesh: DeviceMesh, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The groups of devices varying only along ``axes``, members in axis order."""
    return tuple(tuple(g) for g in mesh.groups(axes))


@functools.lru_cache(maxsize=1024)
def _group_of(mesh: DeviceMesh, axes: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], int], ...]:
    """For each device: (its group's members in axis order, its position there)."""
    out: list[Any] = [None] * mesh.num_devices
    for members in _groups(mesh, axes):
        for pos, k in enumerate(members):
            out[k] = (tuple(members), pos)
    return tuple(out)


def _describe(mesh: DeviceMesh, op: str, axes: tuple[int, ...], params: tuple[Any, ...]) -> str:
    if op == "return":
        return "returned from fn"
    names = tuple(mesh.axis_names[a] for a in axes)
    return f"{op} over {names} with {params}"


def _check_shapes(mesh: DeviceMesh, op: str, axes: tuple[int, ...],
                  values: Sequence[torch.Tensor], free: Sequence[int]) -> None:
    """Within each group: same dtype and rank, same shape except in the dims ``free``."""
    for members in _groups(mesh, axes):
        first = values[members[0]]
        for k in members[1:]:
            v = values[k]
            same = v.dtype == first.dtype and v.ndim == first.ndim and all(
                a == b for d, (a, b) in enumerate(zip(v.shape, first.shape)) if d not in free)
            if not same:
                names = tuple(mesh.axis_names[a] for a in axes)
                rule = ("the same rank" if len(free) == v.ndim else
                        f"the same shape except dim {free[0]}" if free else "the same shape")
                raise ShardingError(
                    f"lax.{op} over {names}: the devices of a group need {rule} and dtype. "
                    f"{mesh.devices[members[0]]!r} has {tuple(first.shape)} {first.dtype}, "
                    f"{mesh.devices[k]!r} has {tuple(v.shape)} {v.dtype}."
                    + (" Uneven blocks can be gathered with all_gather(tiled=True)."
                       if op in ("psum", "pmax", "pmin", "psum_scatter") else "")
                )


class Rendezvous:
    """Where the device threads of one shard_map call meet for each collective."""

    def __init__(self, mesh: DeviceMesh, timeout_s: float) -> None:
        n = mesh.num_devices
        self.mesh = mesh
        self.timeout_s = timeout_s
        self._bufs: tuple[list[Any], list[Any]] = ([None] * n, [None] * n)
        self._seq = [0] * n
        self._checked = 0
        self.doing: list[Any] = [None] * n  # (seq, op, axes, params) while waiting
        self.errors: list[tuple[int, BaseException]] = []
        self.action_error: BaseException | None = None
        self.snapshot: list[Any] | None = None
        self._lock = threading.Lock()
        #: while torch.compile traces: held by the one device running (the tracing
        #: modes' state is shared, not per thread), let go while it waits here
        self.baton: threading.Lock | None = None
        self.barrier = threading.Barrier(n, action=self._check, timeout=timeout_s)

    def exchange(self, k: int, op: str, x: Any, axes: tuple[int, ...],
                 params: tuple[Any, ...]) -> Any:
        s = self._seq[k]
        self._seq[k] = s + 1
        buf = self._bufs[s % 2]
        buf[k] = (op, axes, params, x)
        self.doing[k] = (s, op, axes, params)
        if self.baton is None:
            self.barrier.wait()
        else:
            self.baton.release()
            try:
                self.barrier.wait()
            finally:
                self.baton.acquire()
        self.doing[k] = None
        if op == "return":
            return None
        members, pos = _group_of(self.mesh, axes)[k]
        if k == 0 and comm.active():
            # once, by device 0 (member 0 of its group), on the caller's thread: the event
            # names the user's line, not a worker thread's
            comm.record(spmd.KIND[op], spmd.sent_bytes(op, x, params, 0, len(members)))
        dev = x.device
        vals = [buf[m][3] if buf[m][3].device == dev else buf[m][3].to(dev) for m in members]
        return RULES[op](vals, pos, params)

    def _check(self) -> None:
        """Barrier action (one thread, all deposits in): same op everywhere, and shapes
        that fit together."""
        s = self._checked
        self._checked = s + 1
        buf = self._bufs[s % 2]
        keys = [entry[:3] for entry in buf]
        try:
            if any(key != keys[0] for key in keys):
                calls: dict[Any, list[str]] = {}
                for dev, key in zip(self.mesh.devices, keys):
                    calls.setdefault(key, []).append(repr(dev))
                detail = "; ".join(f"{', '.join(devs)}: {_describe(self.mesh, *key)}"
                                   for key, devs in calls.items())
                raise ShardingError(
                    f"shard_map: the devices made different calls at collective #{s}: "
                    f"{detail}. Every device must call the same lax collectives, in the same "
                    "order, with the same arguments (no device-dependent control flow "
                    "around collectives)."
                )
            op, axes, params = keys[0]
            if op == "return":
                return
            values = [entry[3] for entry in buf]
            free: tuple[int, ...] = (
                (params[0],) if op in ("all_gather", "ragged_all_to_all")
                else (params[1],) if op == "all_to_all"
                else tuple(range(values[0].ndim)) if op == "ppermute" else ())
            _check_shapes(self.mesh, op, axes, values, free)
        except BaseException as err:
            self.action_error = err
            raise

    def fail(self, k: int, err: BaseException) -> None:
        with self._lock:
            if self.snapshot is None:
                self.snapshot = list(self.doing)
            self.errors.append((k, err))
        self.barrier.abort()

    def first_error(self) -> BaseException | None:
        if self.action_error is not None:
            return self.action_error
        for k, err in self.errors:
            if not isinstance(err, threading.BrokenBarrierError):
                _note(err, f"raised by shard_map's fn on device {self.mesh.devices[k]!r} "
                           f"(mesh coordinate {self.mesh.coord_of(k)})")
                return err
        if self.errors:
            doing = self.snapshot or self.doing
            status = "; ".join(
                f"{d!r}: " + ("running fn" if w is None else
                              f"waiting at collective #{w[0]} ({_describe(self.mesh, *w[1:])})")
                for d, w in zip(self.mesh.devices, doing))
            return ShardingError(
                f"shard_map: the devices did not all reach the next collective within "
                f"timeout_s={self.timeout_s:g} s ({status}). A device is stuck or much slower "
                "between two collectives; raise timeout_s= if the work is just long."
            )
        return None


def _note(err: BaseException, text: str) -> None:
    add = getattr(err, "add_note", None)
    if add is not None and text not in getattr(err, "__notes__", ()):
        add(text)


# --- per-device results from the group's values: the in-process collectives -------------
RULES: dict[str, Callable[[Sequence[torch.Tensor], int, tuple[Any, ...]], torch.Tensor]] = {
    "psum": lambda vals, pos, p: collectives.reduce(vals, ReduceOp.SUM),
    "pmax": lambda vals, pos, p: collectives.reduce(vals, ReduceOp.MAX),
    "pmin": lambda vals, pos, p: collectives.reduce(vals, ReduceOp.MIN),
    "all_gather": lambda vals, pos, p: collectives.all_gather(vals, p[0]),
    "psum_scatter": lambda vals, pos, p: collectives.reduce_scatter(vals, p[0], pos),
    "ppermute": lambda vals, pos, p: collectives.ppermute(vals, pos, p[0]),
    "all_to_all": lambda vals, pos, p: collectives.all_to_all(vals, p[0], p[1], pos),
    "ragged_all_to_all": lambda vals, pos, p: collectives.ragged_all_to_all(vals, p[0], pos,
                                                                            p[1]),
}


class SimEnv:
    """The axis environment of one device thread."""

    __slots__ = ("coord", "index", "mesh", "rdv")

    def __init__(self, mesh: DeviceMesh, index: int, rdv: Rendezvous) -> None:
        self.mesh = mesh
        self.index = index
        self.coord = mesh.coord_of(index)
        self.rdv = rdv

    def collective(self, op: str, x: torch.Tensor, axes: tuple[int, ...],
                   params: tuple[Any, ...]) -> torch.Tensor:
        out: torch.Tensor = self.rdv.exchange(self.index, op, x, axes, params)
        return out


_IDLE: list[_Worker] = []
_IDLE_LOCK = threading.Lock()


class _Worker:
    """A daemon thread that runs one task at a time, then waits for the next."""

    __slots__ = ("tasks",)

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="shardwise-device", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.tasks.get()()
            with _IDLE_LOCK:
                _IDLE.append(self)

    @staticmethod
    def submit(task: Callable[[], None]) -> None:
        with _IDLE_LOCK:
            worker = _IDLE.pop() if _IDLE else None
        (worker or _Worker()).tasks.put(task)


def _thread_modes() -> list[Callable[[], Any]]:
    """Makers of context managers that recreate this thread's torch modes (grad,
    inference, autocast: all thread-local) in another thread."""
    grad = torch.is_grad_enabled()
    modes: list[Callable[[], Any]] = [lambda: torch.set_grad_enabled(grad)]
    if torch.is_inference_mode_enabled():
        modes.append(torch.inference_mode)
    for dev in ("cpu", "cuda"):
        if torch.is_autocast_enabled(dev):
            dtype = torch.get_autocast_dtype(dev)
            modes.append(functools.partial(torch.autocast, dev, dtype=dtype))
    if _tracing_now():  # torch.compile tracing (fake, functional, proxy modes)
        modes.append(functools.partial(_tracing, torch._C._dispatch_tls_local_include_set(),
                                       torch._C._dispatch_tls_local_exclude_set(), [
            torch._C._get_dispatch_stack_at(i)
            for i in range(torch._C._len_torch_dispatch_stack())]))
    return modes


def _tracing_now() -> bool:
    """Whether torch.compile is tracing through dispatch modes here (eager code under a
    user's dispatch mode, e.g. a memory ledger, keeps its threads as they were)."""
    return torch.compiler.is_compiling() and bool(torch._C._len_torch_dispatch_stack())


@contextlib.contextmanager
def _tracing(include: Any, exclude: Any, stack: list[Any]) -> Any:
    """The caller's dispatch modes and keys (thread-local) in a worker thread: while
    torch.compile traces (Dynamo's fake values, AOTAutograd's functional graph), each
    device's ops and factories must meet the same modes, and record into the same
    graph; devices run one at a time between rendezvous, under the GIL."""
    python = include.has(torch._C.DispatchKey.PythonDispatcher)
    with torch._C._ForceDispatchKeyGuard(include, exclude), (
            torch._C._EnablePythonDispatcher() if python else contextlib.nullcontext()):
        for mode in stack:
            torch._C._push_on_torch_dispatch_stack(mode)
        try:
            yield
        finally:
            for mode in reversed(stack):
                torch._C._pop_torch_dispatch_stack(getattr(mode, "_mode_key", None))


def run(fn: Callable[..., Any], mesh: DeviceMesh, args: Sequence[Sequence[Any]],
        timeout_s: float) -> list[Any]:
    """``[fn(*args[k]) for every device k]``, device 0 on this thread and the others
    on pooled worker threads, with the lax collectives meeting across the threads.
    Re-raises the first failure."""
    n = mesh.num_devices
    rdv = Rendezvous(mesh, timeout_s)
    results: list[Any] = [None] * n
    done = threading.Semaphore(0)
    modes = _thread_modes()
    if _tracing_now():
        rdv.baton = threading.Lock()

    def work(k: int) -> None:
        prev = spmd.enter(SimEnv(mesh, k, rdv))
        try:
            with contextlib.ExitStack() as stack:
                if rdv.baton is not None:
                    stack.enter_context(rdv.baton)
                if k:
                    for mode in modes:
                        stack.enter_context(mode())
                out = fn(*args[k])
                if n > 1:
                    rdv.exchange(k, "return", None, (), ())
            results[k] = out
        except BaseException as err:
            rdv.fail(k, err)
        finally:
            spmd.enter(prev)
            if k:
                done.release()

    for k in range(1, n):
        _Worker.submit(functools.partial(contextvars.copy_context().run, work, k))
    work(0)
    for _ in range(1, n):
        if not done.acquire(timeout=None if not rdv.errors else timeout_s):
            break  # a device is stuck in fn after a failure: report what we have
    err = rdv.first_error()
    if err is not None:
        raise err
    return results


def run_spmd(fn: Callable[..., Any], mesh: DeviceMesh,
             inputs: Sequence[tuple[Sequence[torch.Tensor | None], Any]], timeout_s: float
             ) -> tuple[list[Any], int | None]:
    """Run ``fn`` once per device on its blocks (one per input), the lax collectives
    meeting across threads; returns the per-device outputs and None (every device
    is in this process)."""
    blocks = [[shards[k] for shards, _ in inputs] for k in range(mesh.num_devices)]
    return run(fn, mesh, blocks, timeout_s), None



def spmd_outputs(mesh: DeviceMesh, index: int | None,
                 blocks: Sequence[Sequence[torch.Tensor | None]], layouts: Sequence[Any],
                 check: bool, shapes: Sequence[tuple[int, ...] | None] = ()) -> SpmdOutputs:
    """shard_map's outputs (see ``Backend.spmd_outputs``): every block is here, so the
    shapes are read (known ``shapes`` too: the caller checks them against these) and the
    replicas compared locally; replicas share one object."""
    metas: list[Any] = []
    shards: list[list[torch.Tensor | None]] = []
    differ: list[tuple[int, ...] | None] = []
    for vals, layout in zip(blocks, layouts):
        present = [v for v in vals if v is not None]
        metas.append([(tuple(v.shape), v.dtype) for v in present])
        reps = layout.representatives()
        shards.append([vals[r] for r in reps])
        bad = None
        if check:
            for k, r in enumerate(reps):
                a, b = vals[k], vals[r]
                assert a is not None and b is not None
                if (r != k and a.shape == b.shape and a.dtype == b.dtype
                        and not torch.allclose(a, b, equal_nan=True)):
                    bad = (k, r)
                    break
        differ.append(bad)
    return metas, shards, differ
