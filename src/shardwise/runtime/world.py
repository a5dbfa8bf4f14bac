"""Whether this process is in a process world, asked on every op: one attribute read.

Invariants:
- ``C10D._default_pg`` is torch.distributed's default process group: None before
  ``init_process_group`` and after ``destroy_process_group``, what
  ``torch.distributed.is_initialized()`` tests, read here without its three Python
  calls (the executor asks on every op whether the backend it cached still applies).
- Where torch has no distributed package, or keeps its world elsewhere, a stand-in
  answers through torch's public function, so the answer is always torch's.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["C10D"]


class _Public:
    """The stand-in: torch's public check, as the default group or None."""

    @property
    def _default_pg(self) -> Any:
        dist = torch.distributed
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _probe() -> Any:
    if not torch.distributed.is_available():
        return _Public()
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    return world if hasattr(world, "_default_pg") else _Public()


#: torch's world record, whose ``_default_pg`` field is the default process group
#: (``runtime.world_started`` is the public question)
C10D: Any = _probe()
