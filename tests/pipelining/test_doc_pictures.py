"""The guide's timeline pictures are what simulate() draws today."""

from pathlib import Path

import pytest

from shardwise.pipelining import compute_table, simulate

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("name, stages", [("1F1B", 4), ("ZBVZeroBubble", 8)])
def test_guide_picture_is_current(name: str, stages: int, tmp_path: Path) -> None:
    out = tmp_path / "t.svg"
    simulate(compute_table(name, stages, 4, 8)).save_svg(out)
    picture = DOCS / f"pipeline_{name.lower()}.svg"
    assert picture.read_text() == out.read_text(), (
        f"{picture} is stale: regenerate it with simulate(compute_table({name!r}, {stages}, 4, "
        "8)).save_svg(path)")
    assert f"pipeline_{name.lower()}.svg" in (DOCS / "guide.md").read_text()
