"""The README's Python examples run as shown (with the fallback warning as an error:
the torch-native example must need no op without a sharding rule)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import shardwise as sw

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", sw.ShardwiseFallbackWarning)
        exec(compile(BLOCKS[index], f"README.md example {index}", "exec"), {})
    assert capsys.readouterr().out  # each example prints something
