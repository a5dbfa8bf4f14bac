"""rich is the optional ``viz`` extra: the core never imports it, and its users
(visualize, the demo) print plain text without it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import shardwise as sw
from shardwise import DeviceMesh, Partial, PlacementMapping, Sharded
from shardwise.cli import demo
from shardwise.debug import visualize

CORE_PATH = """
import sys
import torch
import shardwise as sw
import shardwise.distributed, shardwise.lax, shardwise.debug, shardwise.planner
mesh = sw.DeviceMesh.cpu((2, 2), ("dp", "tp"))
x = sw.tensor(torch.ones(4, 4), sharding=sw.PlacementMapping(mesh, [sw.Sharded(0), sw.Sharded(1)]))
with sw.CommCounter() as cc:
    y = sw.shard(x @ x, mesh, [None, None])
assert cc.counts, cc.counts
print(sorted(m for m in sys.modules if m == "rich" or m.startswith("rich.")))
"""


def test_core_path_does_not_import_rich() -> None:
    out = subprocess.run([sys.executable, "-c", CORE_PATH], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.fixture
def no_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import rich...`` fail as on an install without the viz extra."""
    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "rich", None)
    with pytest.raises(ImportError):
        import rich.console  # noqa: F401


@pytest.mark.usefixtures("no_rich")
def test_visualize_falls_back_to_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    t = sw.zeros((4, 6), sharding=PlacementMapping(mesh, [Sharded(0), Sharded(1)]))
    text = visualize(t, color=False)
    assert text == capsys.readouterr().out.rstrip("\n")
    for block in ("[0:2, 0:3]", "[0:2, 3:6]", "[2:4, 0:3]", "[2:4, 3:6]"):
        assert block in text, text
    assert [f"CPU {k}" in text for k in range(4)] == [True] * 4
    assert "S(dp), S(tp)" in text.splitlines()[0]
    t = sw.zeros((5,), sharding=PlacementMapping(mesh, [Partial(), Sharded(0)]))
    text = visualize(t)
    assert "CPU 0, 2" in text and "partial dp:sum" in text and "[3:5]" in text
    t = sw.zeros((2, 3, 4), sharding=PlacementMapping(mesh, [Sharded(2), Sharded(0)]))
    assert "[0:1, 0:3, 2:4]" in visualize(t)


@pytest.mark.usefixtures("no_rich")
def test_demo_runs_without_rich(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.run(demo.Config(steps=3), (2, 2)) == 0
    out = capsys.readouterr().out
    assert "parity OK" in out and "[green]" not in out
    assert "collectives per forward step: {'all_reduce': 1}" in out
