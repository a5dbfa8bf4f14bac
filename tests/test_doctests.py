"""Every docstring example in the package runs (doctest), module by module.

The examples may use, without importing them, ``torch``, ``shardwise`` (and
``sw``) and the facade's spec names (``DeviceMesh``, ``PlacementMapping``,
``Sharded``, ``Replicated``, ``Partial``, ``ReduceOp``, ``CPU``) besides their
module's own globals; anything else they import themselves.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil
from typing import Any

import pytest
import torch

import shardwise
from shardwise import CPU, DeviceMesh, Partial, PlacementMapping, ReduceOp, Replicated, Sharded

NAMESPACE: dict[str, Any] = {
    "torch": torch, "shardwise": shardwise, "sw": shardwise, "DeviceMesh": DeviceMesh,
    "PlacementMapping": PlacementMapping, "Sharded": Sharded, "Replicated": Replicated,
    "Partial": Partial, "ReduceOp": ReduceOp, "CPU": CPU,
}
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

MODULES = sorted(m.name for m in pkgutil.walk_packages(shardwise.__path__, "shardwise."))


def _examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(
        module, name, globs={**vars(module), **NAMESPACE})
    return [t for t in tests if t.examples]


def test_every_module_is_collected() -> None:
    assert {"shardwise.planner.cache", "shardwise.sharding.shapes", "shardwise.api.creation",
            "shardwise.debug.visualize", "shardwise.runtime.buffers"} <= set(MODULES)
    # the finder sees the examples (a silent finder would make every test below pass)
    assert sum(len(t.examples) for name in MODULES for t in _examples(name)) >= 80


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    out = io.StringIO()
    for test in _examples(name):
        runner.run(test, out=out.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, out.getvalue()
