"""The demo trains with DP x TP and its losses match single-device torch."""

from __future__ import annotations

import subprocess
import sys

import torch

from shardwise.cli import demo
from shardwise.debug import CommCounter


def test_demo_parity_simulated() -> None:
    assert demo.run(demo.Config(steps=25), (2, 4), show=False) == 0


def test_demo_forward_has_exactly_one_all_reduce() -> None:
    import shardwise as sw

    cfg = demo.Config()
    mesh = sw.DeviceMesh.cpu((2, 4), ("dp", "tp"))
    x0, y0, w1, w2 = demo._data(cfg)
    args = (sw.shard(x0, mesh, ["dp", None]), sw.shard(y0, mesh, ["dp", None]),
            sw.shard(w1, mesh, [None, "tp"]), sw.shard(w2, mesh, ["tp", None]))
    with CommCounter() as cc:
        loss = demo._forward(*args)
    assert dict(cc.counts) == {"all_reduce": 1}
    ref = ((torch.nn.functional.gelu(x0 @ w1) @ w2 - y0) ** 2).mean()
    assert torch.allclose(loss.to_torch(), ref, rtol=1e-5)


def test_demo_detects_a_mismatch(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The parity check can fail: a wrong reference must make the demo exit 1."""
    monkeypatch.setattr(demo, "_reference", lambda cfg: [1.0] * cfg.steps)
    assert demo.run(demo.Config(steps=3), (2, 4), show=False) == 1


def test_demo_command() -> None:
    out = subprocess.run([sys.executable, "-m", "shardwise.cli", "demo", "--steps", "30"],
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr
    assert "parity OK" in out.stdout
    assert "collectives per forward step: {'all_reduce': 1}" in out.stdout
