"""A point-to-point link whose two ends are both in this process: a mailbox. The
simulated backend's links are all loopbacks; the process backend's where one process
holds both ends (docs/DESIGN.md §1, the ``Backend`` protocol's ``link``).

Invariants:
- A receive takes the transfer sent under its key (both ends run in this process, in
  program order, so keys pair them as a stream's order would); a receive of a key never
  sent raises at once (nothing else could send it: waiting would never end), and so
  does a second send of a key not yet received.
- A received tensor is the sent one detached (its memory shared, as between the
  replicas of a simulated mesh: nothing in shardwise writes into a value it did not
  make), never requiring grad: the receiver decides, as over a process link.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardwise.sharding.errors import CollectiveError

__all__ = ["Loopback"]


class Loopback:
    """The link between two ends held by this process.

    >>> link = Loopback("device 0 of stage 0 -> stage 1")
    >>> link.send({"n": 1}, [torch.ones(2, requires_grad=True)], "F0")
    >>> info, (x,) = link.recv("F0")
    >>> info, x.requires_grad
    ({'n': 1}, False)
    """

    peer = None   # (no other process: both ends are here)

    def __init__(self, label: str) -> None:
        self.label = label
        self._box: dict[str, tuple[Any, list[torch.Tensor]]] = {}

    def send(self, info: Any, tensors: Sequence[torch.Tensor], key: str) -> None:
        """Leave ``info`` and ``tensors`` (detached) for the receive of ``key``."""
        if key in self._box:
            raise CollectiveError(
                f"Point-to-point send of {key} ({self.label}): it was sent before and not "
                "received yet; every transfer is sent once and received once.")
        self._box[key] = (info, [t.detach() for t in tensors])

    def recv(self, key: str) -> tuple[Any, list[torch.Tensor]]:
        """What the send of ``key`` left: ``(info, tensors)``."""
        try:
            return self._box.pop(key)
        except KeyError:
            raise CollectiveError(
                f"Point-to-point receive of {key} ({self.label}): nothing was sent under "
                "this key, and both ends are in this process, so nothing will be (the "
                "program receives before it sends).") from None
