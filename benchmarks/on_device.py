"""The checks of :mod:`benchmarks.gpu_check`, each run in a process of its own: every
check yields its rows as ``(key, run)``, ``run()`` returning ``(ok, detail, data)``
(``ok`` None: skipped, the detail says why).

- :func:`conformance`: the bodies ``tests/`` runs on both runtimes
  (``tests/helpers/bodies.py``, ``torch_bodies.py``), on meshes of virtual devices on
  one GPU: every ``DeviceMesh.cpu`` they build becomes
  ``VirtualDevice(i, on=Accelerator(0))`` (on the CPU, ``on=CPU(0)`` stands in), and
  the tensors they make themselves are moved to the GPU (:class:`BodiesOnDevice`).
- :func:`examples`: ``examples/gpt.py`` (TP x FSDP) and ``examples/gpt_pp.py`` (PP x
  TP) on a simulated 2x2 mesh of virtual devices on one GPU, each checking every
  step's loss against the same model on that GPU alone.
- :func:`world`: a world of this one process (:mod:`benchmarks.world_of_one`).
- :func:`torchrun`: the multi-process examples, one process per GPU on NCCL (two Gloo
  processes on the CPU); skipped with the reason on fewer than two GPUs.
- :func:`compiled`: ``examples/gpt.py --compile`` (TP x FSDP under
  ``torch.compile(model)``, inductor: Triton kernels on a GPU) on the simulated
  2x2 mesh on one GPU, and under torchrun as :func:`torchrun` runs it; every loss at
  parity with torch, no graph break.
- :func:`speed`: the ``dispatch`` bench section in a world of one process, and the
  training steps of :func:`benchmarks.torchnative.training_steps` beside torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CHECKS", "BodiesOnDevice", "compiled", "conformance", "examples", "speed",
           "torchrun", "virtual_meshes", "world"]

ROOT = Path(__file__).resolve().parent.parent
Row = tuple[bool | None, str, dict[str, Any]]
Rows = Iterator[tuple[str, Callable[[], Row]]]
SMALL = "small"


@contextlib.contextmanager
def virtual_meshes(on: Any) -> Iterator[None]:
    """``DeviceMesh.cpu(shape, names)`` builds ``VirtualDevice(i, on=on)`` meshes
    instead, until the block ends."""
    from shardwise import DeviceMesh, VirtualDevice

    original = DeviceMesh.__dict__["cpu"]

    def cpu(cls: type[DeviceMesh], mesh_shape: Any, axis_names: Any) -> DeviceMesh:
        plain = original.__func__(cls, mesh_shape, axis_names)  # (its checks and errors)
        return cls(tuple(VirtualDevice(i, on=on) for i in range(plain.num_devices)),
                   plain.mesh_shape, plain.axis_names)

    DeviceMesh.cpu = classmethod(cpu)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        DeviceMesh.cpu = original  # type: ignore[method-assign]


class BodiesOnDevice(TorchFunctionMode):
    """Tensors that the bodies make themselves (their own calls of torch's factories:
    ``torch.arange``, ``randn``... from a module under ``tests.``) are made as they are,
    on the CPU with its generators, then moved to ``device``: the bodies' data and
    references live on the GPU, with the values they have on the CPU. shardwise's own
    calls are left alone, so a CPU tensor it makes beside GPU blocks still fails."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        from torch.utils._device import _device_constructors

        self.device, self.factories = device, _device_constructors()

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (func in self.factories and type(out) is torch.Tensor and out.device.type == "cpu"
                and "device" not in (kwargs or {})
                and sys._getframe(1).f_globals.get("__name__", "").startswith("tests.")):
            leaf = out.requires_grad
            out = out.detach().to(self.device).requires_grad_(leaf)
        return out


def _physical(device: str) -> Any:
    from shardwise import CPU, Accelerator

    return CPU(0) if device == "cpu" else Accelerator(0)


CPU_ONLY = {"body_permuted_devices": "builds its mesh of CPU(i) devices by hand"}
"""Bodies that run on the CPU alone, and why (on a GPU their rows say so)."""


def conformance(device: str, size: str) -> Rows:
    """The shared runtime bodies on virtual devices on one GPU (see the module doc)."""
    counts = (4,) if size == SMALL else (2, 4)
    physical = _physical(device)
    with virtual_meshes(physical):
        for key, name in (("conformance.bodies", "bodies"),
                          ("conformance.torch_bodies", "torch_bodies")):
            # imported here, so that the meshes they build at import are virtual too
            module = importlib.import_module(f"tests.helpers.{name}")
            yield key, functools.partial(_bodies, module, counts, device,
                                         BodiesOnDevice(physical.to_torch()))


def _bodies(module: Any, counts: tuple[int, ...], device: str, mode: BodiesOnDevice) -> Row:
    from benchmarks.world_of_one import first_line

    failed: dict[str, str] = {}
    names = [b for b in module.BODIES if device == "cpu" or b not in CPU_ONLY]
    left_out = sorted(set(module.BODIES) - set(names))
    for n in counts:
        for name in names:
            try:
                with mode:
                    getattr(module, name)(n)
            except Exception as err:  # each body reports; the others still run
                failed[f"{name}({n})"] = first_line(err)
    runs = len(names) * len(counts)
    where = f"{_on(device)}, devices {'/'.join(map(str, counts))}"
    also = "".join(f"; {b} left out ({CPU_ONLY[b]})" for b in left_out)
    if failed:
        first, why = next(iter(failed.items()))
        return False, f"{len(failed)}/{runs} failed, first {first}: {why}{also}", {
            "failed": failed, "left_out": left_out}
    return True, f"{runs} runs of {len(names)} bodies on virtual devices {where}{also}", {
        "bodies": names, "devices": list(counts), "left_out": left_out}


def _on(device: str) -> str:
    return "on the CPU" if device == "cpu" else f"on {device}:0"


def examples(device: str, size: str) -> Rows:
    """The GPT examples on a simulated 2x2 mesh of virtual devices on one GPU."""
    from benchmarks.common import example_gpt

    gpt_pp = importlib.import_module("examples.gpt_pp")
    # a GPU's kernels round a block's matmul and an embedding's backward (atomics) apart
    # from the whole's: parity within 1e-3 there (a wrong layout is off by far more)
    rtol = ["--rtol", "1e-3"] if device != "cpu" else []
    common = ["--device", device, "--devices-per-gpu", "4", *rtol]
    small = size == SMALL
    yield "examples.gpt", lambda: _example(example_gpt().main, [
        *common, "--mesh", "2x2", *(["--steps", "2", "--layers", "1"] if small else [])])
    yield "examples.gpt_pp", lambda: _example(gpt_pp.main, [
        *common, "--mesh", "2x1x2", *(["--steps", "2", "--layers", "2"] if small else [])])


def _example(main: Callable[[list[str]], int], argv: list[str]) -> Row:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    text = out.getvalue()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    verdict = next((ln for ln in reversed(lines) if ln.startswith("parity")), "no verdict")
    last = lines[lines.index(verdict) - 1].split() if verdict in lines else []
    diff = f", last step's rel. diff {last[-1]}" if len(last) == 4 else ""
    detail = f"{verdict}{diff}{_compiled_line(text)} ({' '.join(argv)})"
    return code == 0 and verdict == "parity OK", detail, {"output": text[-3000:]}


def _compiled_line(text: str) -> str:
    """``examples/gpt.py --compile``'s summary line (graphs, breaks, first step), as a
    detail's part; empty for a run without it."""
    line = next((ln for ln in text.splitlines() if ln.startswith("compiled (")), None)
    return "" if line is None else "; " + line


def world(device: str, size: str) -> Rows:
    """A world of this one process: collectives, agreement, p2p loopback."""
    from benchmarks import world_of_one

    world_of_one.start(device, timeout_s=30.0)
    try:
        yield "world.collectives", lambda: world_of_one.collectives(device)
        yield "world.agreement", lambda: world_of_one.agreement(device)
        yield "world.p2p", lambda: world_of_one.p2p_loopback(device)
    finally:
        import shardwise.distributed as sd

        sd.shutdown()


def _processes(device: str) -> tuple[int, str | None]:
    """How many processes a torchrun of ``examples/gpt.py`` takes on ``device`` (its
    mesh is 2 x n/2: an even count of GPUs, or two Gloo processes on the CPU), or 0 and
    why it cannot run."""
    if device != "cuda":
        return 2, None
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return 0, (f"{gpus} GPU visible: NCCL runs one process per GPU (it refuses two "
                   "ranks on one GPU); these runs need 2 or more")
    return gpus - gpus % 2, None


def _skipped(why: str) -> Row:
    return None, why, {}


def torchrun(device: str, size: str) -> Rows:
    """The multi-process examples under torchrun: one process per GPU on NCCL, or two
    Gloo processes on the CPU (the pipeline with NCCL's stream layout forced); both
    launches run side by side."""
    small = size == SMALL
    n, why = _processes(device)
    if why is not None:
        yield "torchrun.gpt", functools.partial(_skipped, why)
        yield "torchrun.gpt_pp", functools.partial(_skipped, why)
        return
    steps = "2" if small else "5"
    cuda = device == "cuda"
    gpt = _Torchrun(n, ["examples/gpt.py", "--device", device, "--steps", steps,
                        *(["--rtol", "1e-3"] * cuda)])
    pp = _Torchrun(2, ["examples/gpt_pp.py", "--mesh", "2x1x1", "--steps", steps,
                       *(["--backend", "nccl", "--rtol", "1e-3"] if cuda else [])],
                   {} if cuda else {"SHARDWISE_P2P_STREAM_GROUPS": "1"})
    yield "torchrun.gpt", gpt.result
    yield "torchrun.gpt_pp", pp.result


def compiled(device: str, size: str) -> Rows:
    """``examples/gpt.py --compile``: on the simulated 2x2 mesh of virtual devices on one
    GPU, and under torchrun (one process per GPU on NCCL, two Gloo processes on the
    CPU; skipped with the reason on fewer than two GPUs). Inductor, except in the small
    run on the CPU (the test suite's), where ``aot_eager`` traces the same graphs
    without compiling their C++ (the suite compiles the example with inductor
    itself)."""
    from benchmarks.common import example_gpt

    small = size == SMALL
    how = "aot_eager" if device == "cpu" and small else "inductor"
    cuda = device == "cuda"
    rtol = ["--rtol", "1e-3"] if cuda else []
    sizes = ["--steps", "2", "--layers", "1"] if small else ["--steps", "4"]
    n, why = _processes(device)
    row: Callable[[], Row]
    if why is None:  # (started first: it runs while the simulated row does)
        row = _Torchrun(n, ["examples/gpt.py", "--device", device, *sizes, "--compile",
                            how, *rtol], compiled=True).result
    else:
        row = functools.partial(_skipped, why)
    yield "compile.gpt", lambda: _example(example_gpt().main, [
        "--device", device, "--devices-per-gpu", "4", *rtol, "--mesh", "2x2", *sizes,
        "--compile", how])
    yield "compile.torchrun", row


class _Torchrun:
    """``torchrun --nproc-per-node n argv`` started now, in a session of its own (killed
    whole 15 s before the check's budget ends), its output read by a thread (a full pipe
    would stall it while another launch is waited for); :meth:`result` waits for it."""

    def __init__(self, n: int, argv: list[str], env: dict[str, str] | None = None,
                 compiled: bool = False) -> None:
        from benchmarks.common import free_port
        from benchmarks.gpu_check import BUDGET_ENV

        # inside this check's budget: its process's end would not reach this session
        limit_s = float(os.environ.get(BUDGET_ENV, "240")) - 15

        self.shown = " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), "torchrun",
                               "--nproc-per-node", str(n), *argv])
        self.n, self.limit_s, self.start = n, limit_s, time.monotonic()
        self.compiled = compiled  # (the run must also report its graphs: no break)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
               "--master-port", str(free_port()), *argv]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.got: tuple[str, str, float] | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            out, err = self.proc.communicate(timeout=self.limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()
            return
        self.got = out, err, time.monotonic() - self.start

    def result(self) -> Row:
        self.reader.join()
        if self.got is None:
            return False, f"did not finish within {self.limit_s:.0f} s (killed)", {}
        out, err, took = self.got
        summary = _compiled_line(out)
        if (self.proc.returncode == 0 and out.count("parity OK") == 1
                and (not self.compiled or " 0 graph breaks" in summary)):
            return True, f"parity OK on {self.n} processes{summary} ({self.shown})", {
                "output": out[-2000:], "seconds": took}
        tail = [ln for ln in err.splitlines() if ln.strip()][-1:] or ["no error output"]
        return False, f"exit {self.proc.returncode}: {tail[0][:200]} ({self.shown})", {
            "output": out[-2000:], "errors": err[-4000:], "seconds": took}


def speed(device: str, size: str) -> Rows:
    """Per-op dispatch in a world of one process, and the training steps beside torch."""
    yield "speed.dispatch", lambda: _dispatch(device, size)
    yield "speed.training", lambda: _training(device, size)


def _dispatch(device: str, size: str) -> Row:
    from benchmarks import dispatch, world_of_one
    from benchmarks.common import options_of

    small = size == SMALL
    args = options_of(dispatch.parser(), {
        "device": device, "world": 1, "repeat": 3 if small else 21,
        "inner": 10 if small else 200, "ops": ["gelu", "add", "linear"] if small else []})
    world_of_one.start(device, timeout_s=60.0)   # this process is the one rank
    try:
        res = dispatch.rank_body(args)
    finally:
        import shardwise.distributed as sd

        sd.shutdown()
    rows = res["rows"]
    sw_us = _median([r["shardwise_us"] for r in rows])
    dt_us = _median([r["dtensor_us"] for r in rows])
    floor_us = _median([r["floor_us"] for r in rows])
    met = sum(bool(r["met"]) for r in rows)
    detail = (f"median over {len(rows)} ops: shardwise +{sw_us:.1f} us, DTensor "
              f"+{dt_us:.1f} us, floor +{floor_us:.1f} us above torch; target met on "
              f"{met}/{len(rows)}")
    return True, detail, {"dispatch": res, "table": dispatch.tables(res)}


def _median(values: list[float | None]) -> float:
    got = sorted(v for v in values if v is not None)
    return got[len(got) // 2] if got else math.nan


def _training(device: str, size: str) -> Row:
    from benchmarks import torchnative

    small = size == SMALL
    rows = torchnative.training_steps(3 if small else 10, 5 if small else 50, device,
                                      (32,) if small else (32, 256))
    parts = [f"{_short(r)} {r['ratio']:.2f}x" for r in rows]
    table = torchnative.tables({"ops": [], "mlp": rows[0], "gpt": rows[1:]})[3:]
    if device != "cpu":
        table[0] = (f"training steps, every device of the mesh {_on(device)} beside torch "
                    "there (median ms of wall time to the end of the kernels; ratio of "
                    "medians, of minima):")
    return True, "step time / torch's: " + ", ".join(parts), {"training": rows,
                                                              "table": table}


def _short(row: dict[str, Any]) -> str:
    case = row["case"]
    if case.startswith("Megatron MLP"):
        return "MLP"
    how = "by hand" if "Megatron TP" in case else "planned"
    return f"GPT D={row['dim']} {how}"


CHECKS: dict[str, Callable[[str, str], Rows]] = {
    "conformance": conformance, "examples": examples, "world": world,
    "torchrun": torchrun, "compile": compiled, "speed": speed}
"""Each check by name, in the order the run takes them."""
