"""The torch-native tests share the Megatron MLP helper of the multi-process bodies
(``tests/multiprocess/torch_bodies.py``), so both runtimes shard one way."""

import sys
from pathlib import Path

_BODIES = str(Path(__file__).parents[1] / "multiprocess")
if _BODIES not in sys.path:
    sys.path.insert(0, _BODIES)
