"""This process's torch.distributed world: one object holds what is valid for one world.

Invariants:
- Everything cached per world lives on :data:`WORLD`: process groups by (mesh, axes)
  and torch process groups by member ranks, the point-to-point streams' own groups
  (by sender, receiver and tag), the point-to-point links (``links.py``), the mesh ->
  process index, the pipeline stage meshes, meshes checked against the world size, the
  agreement channels, groups that failed, and the multi-process step specs (which hold
  groups).
  ``WORLD.reset()`` (``shutdown()`` and ``initialize()``) clears them all at once,
  so nothing of an old world survives into a new one; it also counts
  ``WORLD.generation`` up, by which the point-to-point layer forgets its streams.
- The settings of the run live here too: the collective timeout, the default
  agreement check, the opt-in debug check (``SHARDWISE_CHECK_COLLECTIVES=1``), and
  a test hook that gives every point-to-point stream its own group on Gloo too, as
  NCCL needs (``SHARDWISE_P2P_STREAM_GROUPS=1``, read once when this module loads).
- Bookkeeping only: no torch.distributed call is made here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WORLD", "World"]


def _env_check() -> bool:
    return os.environ.get("SHARDWISE_CHECK_COLLECTIVES", "") == "1"


def _env_stream_groups() -> bool:
    return os.environ.get("SHARDWISE_P2P_STREAM_GROUPS", "") == "1"


@dataclass
class World:
    """The world's settings and caches (see the module invariants).

    >>> w = World(timeout_s=10.0)
    >>> w.groups["key"] = "a group"
    >>> w.reset(); w.groups, w.timeout_s
    ({}, 10.0)
    """

    timeout_s: float = 60.0         # every bounded wait of a collective
    agreement: bool = True          # the default-on collective agreement check
    check_collectives: bool = field(default_factory=_env_check)  # the heavy debug check
    # test hook: NCCL's stream layout (one process group per stream) on Gloo as well,
    # so the Gloo tests run the code path NCCL runs (Gloo itself separates streams by tag)
    force_stream_groups: bool = field(default_factory=_env_stream_groups)
    groups: dict[Any, Any] = field(default_factory=dict)
    pgs: dict[tuple[int, ...], Any] = field(default_factory=dict)  # sorted ranks -> group
    streams: dict[tuple[int, int, int], Any] = field(default_factory=dict)  # (src, dst, tag)
    links: dict[Any, Any] = field(default_factory=dict)   # (src mesh, dst mesh, k, stages)
    stages: set[Any] = field(default_factory=set)        # pipeline stage meshes
    index: dict[Any, int | None] = field(default_factory=dict)
    checked: set[Any] = field(default_factory=set)      # meshes that fit the world
    channels: dict[Any, Any] = field(default_factory=dict)
    broken: dict[int, str] = field(default_factory=dict)  # group id -> first failure
    specs: dict[Any, Any] = field(default_factory=dict)   # multi-process step specs
    generation: int = 0   # counted up by reset(): p2p's streams belong to one generation

    def reset(self) -> None:
        """Forget every cache of this world (settings stay)."""
        self.generation += 1
        for cache in (self.groups, self.pgs, self.streams, self.links, self.stages, self.index,
                      self.checked, self.channels, self.broken, self.specs):
            cache.clear()


WORLD = World()
"""The one world of this process."""
