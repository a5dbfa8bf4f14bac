"""The README's Python examples run as shown (in strict mode: no example may need an op
without a sharding rule), and so do the user guide's (docs/guide.md)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import shardwise as sw

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
DOCS = [Path(__file__).resolve().parents[1] / "docs" / "guide.md"]
DOC_BLOCKS = [(doc.name, i, block) for doc in DOCS
              for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(),
                                                   re.S))]


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings(), sw.strict():
        warnings.simplefilter("error", sw.ShardwiseFallbackWarning)
        exec(compile(BLOCKS[index], f"README.md example {index}", "exec"), {})
    assert capsys.readouterr().out  # each example prints something


def test_doc_sections_have_examples() -> None:
    assert {name for name, _, _ in DOC_BLOCKS} == {doc.name for doc in DOCS}


@pytest.mark.parametrize("name, index, block", DOC_BLOCKS,
                         ids=[f"{n}-{i}" for n, i, _ in DOC_BLOCKS])
def test_doc_example_runs(name: str, index: int, block: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings(), sw.strict():
        warnings.simplefilter("error", sw.ShardwiseFallbackWarning)
        exec(compile(block, f"{name} example {index}", "exec"), {})
    assert capsys.readouterr().out  # each example prints something
