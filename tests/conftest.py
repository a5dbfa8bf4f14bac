"""Test setup shared by the whole suite.

pytest runs with ``--import-mode=importlib``, so test modules cannot import
their neighbours; this makes the oracle helpers in ``tests/ops/shardcheck.py``
importable as ``shardcheck``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HELPERS = str(Path(__file__).parent / "ops")
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)
