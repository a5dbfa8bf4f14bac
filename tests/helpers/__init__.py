"""Shared test helpers, imported as ``tests.helpers.<module>`` (never collected:
no module here starts with ``test_``).

Invariants:

- Imported normally: pytest puts the repository root on ``sys.path`` (pyproject's
  ``pythonpath = ["."]``), so ``tests`` is a package there; nothing edits ``sys.path``.
- Processes spawned by :mod:`tests.helpers.harness` inherit that ``sys.path`` (spawn
  sends it to the child), so they import their bodies by module name
  (``bodies.__name__``: ``"tests.helpers.bodies"``).
- Programs launched by path (``forgot_initialize.py``, ``multinode_faults.py``, under
  python or torchrun) import only shardwise, never these helpers: a launched process
  has neither pytest's ``sys.path`` nor its rootdir. :data:`HELPERS_DIR` finds them.

What lives here: named meshes (:mod:`~tests.helpers.meshes`); the oracles
(:mod:`~tests.helpers.shardcheck`, :mod:`~tests.helpers.computecheck`); the GPT plans
and runs (:mod:`~tests.helpers.gpt_plans`, :mod:`~tests.helpers.gpt_runs`); the Gloo
harness (:mod:`~tests.helpers.harness`) and the bodies it runs on every rank (the
``*_bodies`` modules, ``faults``, ``safety``), which the simulated tests run too.
"""

from __future__ import annotations

from pathlib import Path

HELPERS_DIR = Path(__file__).resolve().parent
"""This folder: where the programs launched by path live."""
