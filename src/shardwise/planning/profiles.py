"""Machine profiles: what a device computes and how fast its links move bytes.

Invariants:
- A :class:`Profile` is a frozen value: flop rates per dtype, memory bandwidth and size,
  per-op overheads, the links (an alpha-beta pair: seconds per message hop, seconds per
  byte) within a node and across nodes, and optionally links measured per group
  (``calibrate``: keyed by group size and stride of a mesh axis). On an accelerator a
  kernel's launch overlaps the previous kernel (an op costs the larger of the two);
  on a ``host_bound`` machine (the CPU, which both launches and computes) they add.
- ``p2p``: the link a pipeline stage's send runs on, where calibrated (``calibrate``:
  the median of its measured groups); else a send crosses nodes (``inter``).
- ``cores``: where the ``devices_per_node`` processes share fewer cores (calibrated on
  4 Gloo ranks of a 2-core machine), the rates are those measured with every process
  busy; a process runs faster while others idle (a pipeline's bubble). 0: no sharing.
- A mesh axis is within a node when the devices it spans (its size times the product
  of the sizes of the axes after it, row-major) fit in one node; else it crosses nodes.
- Presets carry published figures (cited beside them), not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from shardwise.sharding.errors import ShardingError
from shardwise.sharding.mesh import DeviceMesh

__all__ = ["PRESETS", "Link", "Profile", "get_profile"]

GiB = 1 << 30


@dataclass(frozen=True)
class Link:
    """A collective over a link costs ``alpha`` seconds per hop plus ``beta`` seconds per
    byte each device sends (CommCounter's bytes)."""

    alpha: float
    beta: float

    def seconds(self, kind: str, group: int, nbytes: int) -> float:
        """Time of one ``kind`` collective over ``group`` devices sending ``nbytes``
        each: ring hops (``2(n-1)`` for all_reduce, ``n-1`` for gathers, scatters and
        all_to_all, 1 for a permute).

        >>> round(Link(1e-5, 1e-9).seconds("all_reduce", 4, 1000), 9)
        6.1e-05
        """
        if group <= 1:
            return 0.0
        hops = {"all_reduce": 2 * (group - 1), "permute": 1}.get(kind, group - 1)
        return self.alpha * hops + self.beta * nbytes


@dataclass(frozen=True)
class Profile:
    """What one device of a machine does per second (module doc).

    >>> h100 = get_profile("h100")
    >>> h100.flop_rate("bfloat16") / 1e12, h100.memory / 2**30
    (989.4, 80.0)
    >>> mesh = DeviceMesh.cpu((16, 8), ("dp", "tp"))
    >>> h100.link(mesh, (1,)) == h100.intra, h100.link(mesh, (0,)) == h100.inter
    (True, True)
    """

    name: str
    flops: dict[str, float]
    memory_bandwidth: float
    memory: int
    intra: Link
    inter: Link
    devices_per_node: int = 8
    op_overhead: float = 0.0
    kernel_overhead: float = 0.0
    overlap: float = 0.0
    groups: dict[tuple[int, int], Link] = field(default_factory=dict)
    host_bound: bool = False
    cores: int = 0
    p2p: Link | None = None

    def flop_rate(self, dtype: Any) -> float:
        """FLOP/s for matmuls in ``dtype`` (a torch dtype or its name)."""
        name = str(dtype).removeprefix("torch.")
        return self.flops.get(name, self.flops.get("float32", min(self.flops.values())))

    def link(self, mesh: DeviceMesh, axes: tuple[int, ...]) -> Link:
        """The link a collective over mesh ``axes`` runs on: a measured group's, else
        within a node or across nodes (the slowest of the axes)."""
        shape = mesh.mesh_shape
        size = math.prod(shape[a] for a in axes)
        stride = math.prod(shape[max(axes) + 1:]) if axes else 1
        hit = self.groups.get((size, stride))
        if hit is not None:
            return hit
        span = math.prod(shape[min(axes):]) if axes else 1
        return self.intra if span <= self.devices_per_node else self.inter

    def with_groups(self, groups: dict[tuple[int, int], Link], **changes: Any) -> Profile:
        """This profile with measured links (and other fields) replaced."""
        return replace(self, groups={**self.groups, **groups}, **changes)


# Published figures. H100 SXM5 (NVIDIA H100 datasheet): 989.4 TFLOP/s dense BF16/FP16,
# 494.7 TF32, 66.9 FP32; 3.35 TB/s HBM3, 80 GB. NVLink 4: 900 GB/s per GPU, 450 GB/s each
# way; across nodes one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s). A100 SXM4 80GB
# (A100 datasheet): 312 TFLOP/s BF16/FP16, 156 TF32, 19.5 FP32; 2.04 TB/s HBM2e; NVLink 3:
# 600 GB/s per GPU (300 each way); HDR InfiniBand 200 Gb/s per GPU (25 GB/s). Latencies:
# NCCL's small-message hop within a node ~5 us, across InfiniBand ~10 us (nccl-tests).
PRESETS: dict[str, Profile] = {
    "h100": Profile(
        "h100", {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 66.9e12},
        memory_bandwidth=3.35e12, memory=80 * GiB,
        intra=Link(5e-6, 1 / 450e9), inter=Link(10e-6, 1 / 50e9),
        kernel_overhead=4e-6, overlap=1.0),
    "a100": Profile(
        "a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
        memory_bandwidth=2.04e12, memory=80 * GiB,
        intra=Link(5e-6, 1 / 300e9), inter=Link(10e-6, 1 / 25e9),
        kernel_overhead=4e-6, overlap=1.0),
}


def get_profile(profile: str | Profile | None) -> Profile:
    """A preset by name (``"h100"``, ``"a100"``), a :class:`Profile` as it is, or the
    H100 preset for None.

    >>> get_profile("a100").name
    'a100'
    >>> get_profile("tpu")
    Traceback (most recent call last):
    ...
    shardwise.sharding.errors.ShardingError: Cannot find profile 'tpu'. Got one of \
['a100', 'h100']; pass a preset name, a Profile, or shardwise.calibrate()'s result.
    """
    if profile is None:
        return PRESETS["h100"]
    if isinstance(profile, Profile):
        return profile
    hit = PRESETS.get(str(profile).lower()) if isinstance(profile, str) else None
    if hit is None:
        raise ShardingError(
            f"Cannot find profile {profile!r}. Got one of {sorted(PRESETS)}; pass a preset "
            "name, a Profile, or shardwise.calibrate()'s result.")
    return hit
