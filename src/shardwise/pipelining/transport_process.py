"""The pipeline transport between processes (torchrun, Gloo or NCCL): a stage's
activations and gradients cross to the next stage's processes with their layouts.

The process at (dp, tp) coordinate ``c`` of stage ``src``'s mesh sends its local block
of every shardwise Tensor to the process at the same coordinate ``c`` of stage
``dst``'s mesh, which rebuilds the Tensor with the same placements on its own mesh
(a tp-sharded activation stays sharded on the receiving stage's tp group; a Partial
gradient stays Partial). Plain torch tensors, None and scalars travel as they are,
from each process to its peer.

Invariants:
- Stage meshes have one shape (submeshes of one mesh); process ``mesh_src.devices[c]``
  pairs with ``mesh_dst.devices[c]`` only, so every transfer is one point-to-point
  exchange (:mod:`shardwise.runtime.process.p2p`) on the stream of (src, dst): the
  failure model of every collective holds (bounded waits, a clear
  :class:`CollectiveError` naming the peer, the stages and the tag).
- A received tensor is a new leaf; it records gradients when the sent one did (the
  receiving stage's backward stays its own, as torch's stages do).
- A received block must have the shape its global shape and layout give on the
  receiving process (shapes may change between microbatches, never disagree), and
  lands on the device the receiving mesh gives it (``backend.device_of``); a plain
  torch tensor arrives on the transport's device (the GPU on NCCL, the CPU on Gloo).
- On Gloo the streams share the world group (tags separate them); on NCCL (or with
  the test hook ``SHARDWISE_P2P_STREAM_GROUPS=1``) each stream runs on its own group,
  made by ``prepare_stage_groups`` (``pipeline()``): a missing one is refused.
- Gloo or NCCL: another backend, NCCL without a GPU or a torch without NCCL is
  refused when the transport is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from shardwise.runtime.process import collectives as D
from shardwise.runtime.process import p2p
from shardwise.runtime.process.backend import device_of
from shardwise.runtime.process.world import WORLD
from shardwise.sharding.errors import CollectiveError, ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import local_shape
from shardwise.tensors.tensor import Tensor

__all__ = ["ProcessTransport"]


class ProcessTransport:
    """Send and receive pipeline values between stages held by other processes.

    ``stage_meshes[s]`` is stage ``s``'s mesh (``mesh.submesh(pp=rank_of(s))``); every
    process builds the transport with the same list. ``send`` returns at once (the
    transfer completes when the peer receives it; :meth:`flush` waits, bounded).

    >>> t = ProcessTransport([mesh.submesh(pp=0), mesh.submesh(pp=1)])  # doctest: +SKIP
    >>> t.send(activation, 0, 1, "F0")      # on stage 0's processes  # doctest: +SKIP
    >>> x = t.recv(0, 1, "F0")              # on stage 1's processes  # doctest: +SKIP
    """

    def __init__(self, stage_meshes: Sequence[DeviceMesh]) -> None:
        self.meshes = list(stage_meshes)
        shapes = {(m.mesh_shape, m.axis_names) for m in self.meshes}
        if len(shapes) > 1:
            raise ShardingError(
                f"ProcessTransport needs stage meshes of one shape (submeshes of one mesh "
                f"along the pipeline axis). Got {self.meshes}.")
        p2p.check_backend("The pipeline transport between processes")
        # NCCL: each stream on its own group (WORLD.streams, by (sender, receiver, tag));
        # Gloo: None, the world group and its tags (one dict lookup less per transfer)
        self._streams = WORLD.streams if p2p.needs_stream_groups() else None
        self._local: dict[tuple[int, int, str], Any] = {}  # both stages in this process
        self._peers: dict[tuple[int, int], int | None] = {}  # a hop's peer, once found
        self._devices: dict[int, torch.device] = {}  # stage -> where its blocks live here

    def _peer(self, here: int, there: int, what: str, tag: str) -> int | None:
        """The rank at this process's coordinate of stage ``there`` (None: this one)."""
        got = self._peers.get((here, there), -1)
        if got != -1:
            return got
        for s in (here, there):
            if not 0 <= s < len(self.meshes):
                raise ShardingError(
                    f"Pipeline {what} {tag}: stage {s} is not one of the "
                    f"{len(self.meshes)} stages (0..{len(self.meshes) - 1}).")
        k = D.my_index(self.meshes[here])
        if k is None:
            raise ShardingError(
                f"Pipeline {what} of {tag} between stages {here} and {there} on rank "
                f"{dist.get_rank()}, which holds no device of stage {here}'s mesh "
                f"{self.meshes[here]!r} (devices {[d.id for d in self.meshes[here].devices]}): "
                "only the stage's processes send and receive its values.")
        peer = self.meshes[there].devices[k].id
        found = self._peers[(here, there)] = None if peer == dist.get_rank() else peer
        return found

    def send(self, value: Any, src_stage: int, dst_stage: int, tag: str) -> None:
        """Send ``value`` (a pytree of shardwise Tensors, torch tensors, None, scalars)
        from stage ``src_stage`` (held here) to ``dst_stage``."""
        peer = self._peer(src_stage, dst_stage, "send", tag)
        if peer is None:
            self._local[(src_stage, dst_stage, tag)] = _fresh(value)
            return
        leaves, text = p2p.flatten(value)
        mesh = self.meshes[src_stage]
        metas: list[Any] = []
        blocks: list[torch.Tensor] = []
        for x in leaves:
            meta, block = _part(x, mesh)
            metas.append(meta)
            if block is not None:
                blocks.append(block)
        stream = p2p.stream_tag(src_stage, dst_stage)
        p2p.send_parts([text, metas], blocks, peer, stream,
                       _key(src_stage, dst_stage, tag),
                       None if self._streams is None else self._group(
                           dist.get_rank(), peer, stream, src_stage, dst_stage))

    def recv(self, src_stage: int, dst_stage: int, tag: str) -> Any:
        """The value stage ``src_stage`` sent to ``dst_stage`` (held here) under ``tag``,
        rebuilt on ``dst_stage``'s mesh."""
        peer = self._peer(dst_stage, src_stage, "receive", tag)
        if peer is None:
            try:
                return self._local.pop((src_stage, dst_stage, tag))
            except KeyError:
                raise CollectiveError(
                    f"Pipeline receive of {tag} from stage {src_stage} to stage {dst_stage}: "
                    "nothing was sent (both stages are on this process).") from None
        key = _key(src_stage, dst_stage, tag)
        stream = p2p.stream_tag(src_stage, dst_stage)
        (spec_text, metas), blocks = p2p.recv_parts(
            peer, stream, key,
            None if self._streams is None else self._group(peer, dist.get_rank(), stream,
                                                           src_stage, dst_stage))
        mesh = self.meshes[dst_stage]
        dev = self._devices.get(dst_stage)
        if dev is None:
            k = D.my_index(mesh)
            assert k is not None
            dev = self._devices[dst_stage] = device_of(mesh, k)
        it = iter(blocks)
        leaves = [_rebuild(m, next(it) if m[0] != "v" else None, mesh, key, peer, dev)
                  for m in metas]
        return p2p.unflatten(leaves, spec_text)

    def _group(self, sender: int, receiver: int, stream: int, src: int, dst: int) -> Any:
        """The process group of the stream from ``sender`` to ``receiver`` (NCCL)."""
        assert self._streams is not None
        pg = self._streams.get((sender, receiver, stream))
        if pg is None:
            raise ShardingError(
                f"Pipeline transfer from stage {src} (rank {sender}) to stage {dst} (rank "
                f"{receiver}): this backend ({dist.get_backend()!r}) needs a process group "
                "per stream and this one has none. Build the stages with pipeline(), or "
                "call shardwise.runtime.process.groups.prepare_stage_groups(mesh, axis, "
                "stage_meshes) on every process before the first transfer.")
        return pg

    def flush(self) -> None:
        """Wait until every value this process sent was received (bounded)."""
        p2p.flush()


def _key(src: int, dst: int, tag: str) -> str:
    return f"{tag} from stage {src} to stage {dst}"


def _part(x: Any, mesh: DeviceMesh) -> tuple[Any, torch.Tensor | None]:
    """A leaf's description for the receiver (JSON) and the tensor that carries it:
    a shardwise Tensor's layout (its dims and Partial ops), global shape and whether it
    records gradients, with this process's block; a torch tensor's gradient flag, with
    itself; any other value, as it is."""
    if isinstance(x, Tensor):
        if x.mesh != mesh:
            raise ShardingError(
                f"Pipeline send: a Tensor on {x.mesh!r} leaves the stage on {mesh!r}; a stage "
                "sends values on its own mesh (relayout it onto the stage mesh first).")
        k = D.my_index(mesh)
        assert k is not None
        block = x.shards[k]
        assert block is not None, "a process holds its own block"
        return _layout_meta(x), block
    if isinstance(x, torch.Tensor):
        return ["t", x.requires_grad], x  # (p2p copies its bytes: no autograd involved)
    p2p.check_value(x, "Pipeline send")
    return ["v", x], None


def _layout_meta(x: Tensor) -> list[Any]:
    """What the receiver needs besides a shardwise Tensor's block (JSON): its layout's
    dims and Partial ops, its global shape, whether it records gradients."""
    lay = x.dist_layout
    return ["sw", [list(d) for d in lay.dims],
            [None if p is None else p.value for p in lay.partial], list(x.shape),
            x.requires_grad]


def _rebuild(meta: Any, block: Any, mesh: DeviceMesh, key: str, peer: int,
             dev: torch.device) -> Any:
    if meta[0] == "v":
        return meta[1]
    if meta[0] == "t":
        return block.requires_grad_(True) if meta[1] and _grads(block) else block
    _, dims, partial, shape, grad = meta
    layout = Layout(mesh, tuple(tuple(d) for d in dims),
                    tuple(None if p is None else ReduceOp(p) for p in partial))
    k = D.my_index(mesh)
    assert k is not None
    want = local_shape(tuple(shape), layout, mesh.coord_of(k))
    if tuple(block.shape) != want:
        raise CollectiveError(
            f"Pipeline receive of {key} on rank {dist.get_rank()}: rank {peer} sent a block of "
            f"shape {tuple(block.shape)}, but global shape {tuple(shape)} laid out as {layout} "
            f"puts shape {want} here: the stages' meshes or layouts disagree.")
    if block.device != dev:  # e.g. NCCL's GPU message for a CPU mesh
        block = block.to(dev)
    if grad and _grads(block):
        block.requires_grad_(True)
    shards: list[torch.Tensor | None] = [None] * mesh.num_devices
    shards[k] = block
    return Tensor(shards, layout, shape, block.dtype)


def _grads(x: torch.Tensor) -> bool:
    return x.dtype.is_floating_point or x.dtype.is_complex


def _fresh(value: Any) -> Any:
    """A same-process hand-over: detached leaves that record gradients as the sent did."""
    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().requires_grad_(x.requires_grad)
        return x
    return pytree.tree_map(leaf, value)
