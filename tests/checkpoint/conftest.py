"""The checkpoint tests import their helpers (``gpt_runs``, ``ckpt_bodies``) and the
multi-process harness (``tests/multiprocess/harness.py``) by name."""

import sys
from pathlib import Path

for _dir in (Path(__file__).parent, Path(__file__).parents[1] / "multiprocess"):
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))
