"""shardwise on a GPU in one command: correctness on CUDA, NCCL in one process, the
multi-process examples where several GPUs are visible, and the speed numbers worth
keeping; a short table and ``bench-results/gpu-<device>.json``.

    bash scripts/gpu_check.sh                          # on a GPU machine (about 5 minutes)
    python -m benchmarks.gpu_check --device cpu --size small --out DIR   # the suite's run

The rows (:mod:`benchmarks.on_device` says what each runs):

- conformance: the runtime bodies ``tests/`` runs on both runtimes, on a mesh of
  virtual devices on one GPU;
- the GPT examples (TP x FSDP, PP x TP) on a simulated 2x2 mesh of virtual devices on
  one GPU, at parity with torch on that GPU;
- a world of one process (NCCL; Gloo on the CPU): every collective with torch beside
  it, the agreement check's control message, the pipeline transport to itself;
- torchrun runs of the multi-process examples (on two or more GPUs; else SKIP);
- ``examples/gpt.py --compile`` (inductor) on the simulated mesh and under torchrun;
- speed: per-op dispatch (torch, the wrapper floor, DTensor on a one-device mesh,
  shardwise) and the simulated training steps beside torch.

Invariants:
- A row is PASS, FAIL (with its error's first line) or SKIP (with the reason: this is
  a report, not a test). The run exits 1 when a row failed, else 0.
- Every check runs in a fresh process under its own time budget (:data:`BUDGETS`), so
  one that fails, hangs or breaks its CUDA context is reported and the others still
  run; the correctness checks run side by side, then the speed check alone (at
  ``--size small`` beside them: its timings are not kept). The whole run stays within
  :data:`TOTAL_S` (8 minutes): a check that would start past it is skipped, saying so.
- The JSON is written after every check: a run cut short keeps what it measured.
  ``--out DIR`` writes it there instead (the test suite's run never touches the
  repository).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["BUDGETS", "ROWS", "TOTAL_S", "main", "run", "table"]

ROOT = Path(__file__).resolve().parent.parent
TOTAL_S = 480.0
"""The whole run's budget, in seconds (8 minutes on one GPU)."""
BUDGETS: dict[str, dict[str, float]] = {   # seconds per check, by size (the correctness
    "conformance": {"small": 150, "full": 150},   # checks run side by side: with speed's,
    "examples": {"small": 150, "full": 150},      # at most 150 + 150 s in all)
    "world": {"small": 90, "full": 90},
    "torchrun": {"small": 150, "full": 150},
    "compile": {"small": 150, "full": 150},
    "speed": {"small": 150, "full": 150},
}
ROWS: dict[str, tuple[str, ...]] = {   # each check's rows, in order
    "conformance": ("conformance.bodies", "conformance.torch_bodies"),
    "examples": ("examples.gpt", "examples.gpt_pp"),
    "world": ("world.collectives", "world.agreement", "world.p2p"),
    "torchrun": ("torchrun.gpt", "torchrun.gpt_pp"),
    "compile": ("compile.gpt", "compile.torchrun"),
    "speed": ("speed.dispatch", "speed.training"),
}
_MARK = "GPU_CHECK_ROW "
BUDGET_ENV = "SHARDWISE_GPU_CHECK_BUDGET_S"


def _titles(device: str) -> dict[str, str]:
    on = "on the CPU" if device == "cpu" else "on one GPU"
    backend = "Gloo" if device == "cpu" else "NCCL"
    procs = "2 Gloo processes" if device == "cpu" else "NCCL, one per GPU"
    return {
        "conformance.bodies": f"runtime bodies, virtual devices {on}",
        "conformance.torch_bodies": f"torch bodies, virtual devices {on}",
        "examples.gpt": f"gpt.py TP x FSDP (2x2) {on}",
        "examples.gpt_pp": f"gpt_pp.py PP x TP (2x1x2) {on}",
        "world.collectives": f"{backend} world of 1: collectives",
        "world.agreement": f"{backend} world of 1: agreement check",
        "world.p2p": f"{backend} world of 1: p2p loopback",
        "torchrun.gpt": f"torchrun gpt.py ({procs})",
        "torchrun.gpt_pp": f"torchrun gpt_pp.py ({procs})",
        "compile.gpt": f"compiled gpt.py TP x FSDP (2x2) {on}",
        "compile.torchrun": f"compiled gpt.py under torchrun ({backend})",
        "speed.dispatch": f"speed: per-op dispatch, {backend} rank",
        "speed.training": f"speed: training steps {on}",
    }


# --- the child: one check's rows ------------------------------------------------------------
def _child(check: str, device: str, size: str) -> int:
    """Run one check's rows in this process, each reported on its own stdout line."""
    from benchmarks.on_device import CHECKS
    from benchmarks.world_of_one import first_line

    budget = os.environ.get(BUDGET_ENV)
    if budget:   # launched by the runner: end at the budget even if the runner is gone
        signal.alarm(int(float(budget)) + 5)
    done: list[str] = []
    try:
        for key, fn in CHECKS[check](device, size):
            start = time.monotonic()
            try:
                ok, detail, data = fn()
            except (Exception, SystemExit) as err:  # every failure is a row
                import traceback

                ok, detail, data = False, first_line(err), {
                    "traceback": traceback.format_exc()[-4000:]}
            status = "SKIP" if ok is None else "PASS" if ok else "FAIL"
            # (a row whose work ran beside others' gives its own time)
            took = data.pop("seconds", None) or time.monotonic() - start
            _emit(key, status, detail, data, took)
            done.append(key)
    except Exception as err:  # the check itself broke: its other rows say why
        for key in ROWS[check]:
            if key not in done:
                _emit(key, "FAIL", first_line(err), {}, 0.0)
    return 0


def _emit(key: str, status: str, detail: str, data: dict[str, Any], seconds: float) -> None:
    row = {"key": key, "status": status, "detail": detail, "seconds": round(seconds, 2),
           "data": data}
    sys.stdout.write(_MARK + json.dumps(row, default=str) + "\n")
    sys.stdout.flush()


# --- the parent: every check in a process of its own ------------------------------------------
PARALLEL = ("conformance", "examples", "world", "torchrun", "compile")
"""The correctness checks, run side by side; ``speed`` runs alone afterwards, so that
nothing shares the machine with its timings (at ``--size small``, whose timings are
too short to keep, it runs beside them)."""


class _Launched:
    """One check's process, its output in files (a full pipe would stall it), its
    deadline."""

    def __init__(self, check: str, device: str, size: str, budget: float) -> None:
        self.check, self.budget = check, budget
        self.deadline = time.monotonic() + budget
        # (closed by rows(): the process writes them while the run goes on)
        self.out = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.err = tempfile.TemporaryFile("w+")  # noqa: SIM115
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--child", check,
               "--device", device, "--size", size]
        # (the budget goes along: a check that starts processes of their own session,
        # which killing this one's would miss, ends them within it)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.out, stderr=self.err,
                                     text=True, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1",
                                          BUDGET_ENV: f"{budget:.0f}"})

    def rows(self) -> list[dict[str, Any]]:
        """Its rows once it ended (killed at its deadline); a row it never reported is a
        FAIL naming why (the budget, or its last error line)."""
        why = None
        try:
            self.proc.wait(timeout=max(self.deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            why = f"did not finish within its budget of {self.budget:.0f} s (killed)"
        out, err = (self._read(f) for f in (self.out, self.err))
        rows = [json.loads(ln[len(_MARK):]) for ln in out.splitlines() if ln.startswith(_MARK)]
        seen = {r["key"] for r in rows}
        last = [ln for ln in err.splitlines() if ln.strip()][-1:] or [
            f"exit {self.proc.returncode} with no error output"]
        for key in ROWS[self.check]:
            if key not in seen:
                rows.append({"key": key, "status": "FAIL", "detail": why or last[0][:240],
                             "seconds": 0.0, "data": {"errors": err[-4000:]}})
        return rows

    @staticmethod
    def _read(f: Any) -> str:
        f.seek(0)
        text = str(f.read())
        f.close()
        return text


def run(device: str, size: str = "full", out: Path | None = None,
        only: list[str] | None = None, say: Any = print) -> dict[str, Any]:
    """Every check (or ``only`` those) on ``device``; the JSON-ready result, written to
    ``out`` (a folder; default ``bench-results/``) after every check."""
    path = (out or ROOT / "bench-results") / f"gpu-{device}.json"
    titles = _titles(device)
    result: dict[str, Any] = {"benchmark": "gpu_check", "meta": _meta(device, size),
                              "rows": []}
    say(_header(result["meta"]))
    say(_line("check", "result", "time", "detail"))
    start = time.monotonic()
    chosen = [c for c in ROWS if not only or c in only]

    def launch(check: str) -> _Launched | None:
        left = TOTAL_S - (time.monotonic() - start)
        return _Launched(check, device, size, min(BUDGETS[check][size], left)) if (
            left >= 20) else None

    side_by_side = {c: launch(c) for c in chosen if c in PARALLEL or size == "small"}
    for check in chosen:
        launched = side_by_side[check] if check in side_by_side else launch(check)
        rows = launched.rows() if launched is not None else [
            {"key": k, "status": "SKIP", "seconds": 0.0, "data": {},
             "detail": f"the run's {TOTAL_S:.0f} s were spent"} for k in ROWS[check]]
        for r in rows:
            r["title"] = titles[str(r["key"])]
            say(_line(str(r["title"]), str(r["status"]), f"{r['seconds']:.1f}s",
                      str(r["detail"])))
        result["rows"] += rows
        result["meta"]["seconds"] = round(time.monotonic() - start, 1)
        _write(path, result)
    for line in speed_lines(result):
        say(line)
    counts = {s: sum(r["status"] == s for r in result["rows"]) for s in ("PASS", "FAIL", "SKIP")}
    say(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in "
        f"{result['meta']['seconds']:.0f} s; JSON: {path}")
    result["path"] = str(path)
    return result


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")


def _line(title: str, status: str, seconds: str, detail: str) -> str:
    return f"  {title:42} {status:6} {seconds:>6}  {detail}"


def _meta(device: str, size: str) -> dict[str, Any]:
    """The run's setting (torch is imported here only for a GPU's: the checks run in
    their own processes, and importing it costs the CPU run seconds)."""
    from importlib import metadata

    meta: dict[str, Any] = {"device": device, "size": size,
                            "torch": metadata.version("torch"),
                            "python": platform.python_version(), "host": platform.node()}
    if device != "cpu":
        import torch

        meta["torch"] = torch.__version__
        if torch.cuda.is_available():
            meta.update({"gpu": torch.cuda.get_device_name(0),
                         "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda,
                         "nccl": ".".join(map(str, torch.cuda.nccl.version()))})
    return meta


def _header(meta: dict[str, Any]) -> str:
    where = (f"{meta['gpu']} x{meta['gpus']}, CUDA {meta['cuda']}, NCCL {meta['nccl']}"
             if "gpu" in meta else f"{os.cpu_count()} CPU cores")
    return (f"shardwise GPU check on {meta['device']} ({where}), torch {meta['torch']}, "
            f"size {meta['size']}")


def speed_lines(result: dict[str, Any]) -> list[str]:
    """The speed rows' own tables (what the bench sections print, as the check wrote
    them)."""
    return [ln for r in result["rows"] for ln in (r.get("data") or {}).get("table", [])]


def table(result: dict[str, Any]) -> list[str]:
    """The result's rows as the table ``run`` prints."""
    return [_line("check", "result", "time", "detail"), *(
        _line(r["title"], r["status"], f"{r['seconds']:.1f}s", r["detail"])
        for r in result["rows"])]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda where torch sees a GPU, else cpu")
    p.add_argument("--size", choices=("small", "full"), default="full")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write gpu-<device>.json here (default: bench-results/)")
    p.add_argument("--only", nargs="+", choices=list(ROWS), default=None,
                   help="run these checks alone")
    p.add_argument("--child", choices=list(ROWS), default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        return _child(args.child, device, args.size)
    result = run(device, args.size, args.out, args.only)
    return 1 if any(r["status"] == "FAIL" for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
