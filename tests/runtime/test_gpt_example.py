"""examples/gpt.py trains with TP x FSDP on the simulated mesh and, unchanged, under
torchrun; it checks every loss against single-device torch (exit 1 on a mismatch),
and --save / --resume continue a run on another mesh."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers.harness import free_port, run_bounded

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"


LIMIT_S = 240


def test_simulated_save_then_resume_on_another_mesh(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    first = run_bounded([sys.executable, str(GPT), "--steps", "3", "--save", ck], LIMIT_S)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "DeviceMesh(dp=2, tp=4) (simulated)" in first.stdout
    assert "[S(tp,dp), R]" in first.stdout  # wq: column-parallel, then FSDP within tp
    assert "parity OK" in first.stdout and "saved step 3" in first.stdout
    again = run_bounded([sys.executable, str(GPT), "--steps", "5", "--resume", ck,
                         "--mesh", "4x2"], LIMIT_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "at step 3" in again.stdout
    assert "parity OK" in again.stdout


def test_a_loss_mismatch_exits_non_zero() -> None:
    out = run_bounded([sys.executable, str(GPT), "--steps", "1", "--rtol", "-1"], LIMIT_S)
    assert out.returncode == 1
    assert "parity FAILED" in out.stdout


def test_unchanged_under_torchrun() -> None:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    out = run_bounded([torchrun, "--nproc-per-node", "4", "--master-port", str(free_port()),
                str(GPT), "--steps", "3"], LIMIT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DeviceMesh(dp=2, tp=2) (torch.distributed, 4 processes)" in out.stdout
    assert out.stdout.count("parity OK") == 1  # only process 0 prints


def test_compiled_with_context_parallel_on_the_simulated_mesh() -> None:
    """``--compile`` on its first call under context parallel (the sequence in head-tail
    order): one graph, no break, at parity. The first reorder index used to be made
    and cached while Dynamo traced on fake tensors, and the next call met it."""
    out = run_bounded([sys.executable, str(GPT), "--cp", "2", "--steps", "3",
                       "--compile", "aot_eager"], LIMIT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DeviceMesh(dp=2, cp=2, tp=2) (simulated)" in out.stdout
    assert "compiled (aot_eager): 1 graphs, 0 graph breaks" in out.stdout
    assert "parity OK" in out.stdout


def test_compiled_with_inductor_under_torchrun() -> None:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    out = run_bounded([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()),
                       str(GPT), "--steps", "3", "--layers", "1", "--compile"], LIMIT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DeviceMesh(dp=2, tp=1) (torch.distributed, 2 processes)" in out.stdout
    assert out.stdout.count("compiled (inductor): 1 graphs, 0 graph breaks") == 1
    assert out.stdout.count("parity OK") == 1
