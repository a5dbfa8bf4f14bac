"""The pipeline transport between processes (torchrun, Gloo or NCCL): a stage's
activations and gradients cross to the next stage's processes with their layouts.

The process at (dp, tp) coordinate ``c`` of stage ``src``'s mesh sends its local block
of every shardwise Tensor to the process at the same coordinate ``c`` of stage
``dst``'s mesh, which rebuilds the Tensor with the same placements on its own mesh
(a tp-sharded activation stays sharded on the receiving stage's tp group; a Partial
gradient stays Partial). Plain torch tensors, None and scalars travel as they are,
from each process to its peer. What moves the bytes is the runtime's: a link of the
``Backend`` protocol per stage pair and direction (``backend.link``), which this module
reaches only through :func:`~shardwise.runtime.backend_for`.

Invariants:
- Stage meshes have one shape (submeshes of one mesh); process ``mesh_src.devices[c]``
  pairs with ``mesh_dst.devices[c]`` only, so every transfer is one transfer on the
  link of (src, dst) at ``c``, whose failure model is the runtime's (on processes:
  bounded waits, a clear :class:`CollectiveError` naming the peer, the stages and the
  tag). A process carries one device of each stage it holds (the process mesh; a
  simulated mesh with one device per stage).
- A received tensor is a new leaf; it records gradients when the sent one did (the
  receiving stage's backward stays its own, as torch's stages do).
- A received block must have the shape its global shape and layout give on the
  receiving process (shapes may change between microbatches, never disagree), and
  lands on the device the receiving mesh gives it (``backend.device_of``); a plain
  torch tensor arrives where the link delivers it (the GPU on NCCL, the CPU on Gloo).
- The links between adjacent stages that this process holds an end of are made when
  the transport is built: a runtime they cannot run on (on processes: another backend
  than Gloo or NCCL, NCCL without a GPU or a torch without NCCL) is refused then.
- Per transfer: one dict lookup for the link, the value's leaves, one call to the link.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardwise.runtime import Link, backend_for, world_backend
from shardwise.runtime.trees import check_value, flatten, unflatten
from shardwise.sharding.errors import CollectiveError, ShardingError
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.orders import SequenceOrder
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import local_shape
from shardwise.tensors.tensor import Tensor

__all__ = ["ProcessTransport"]

End = tuple[Link, int, torch.device]   # a link, this process's device index, its device


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
        self._backend = backend_for(self.meshes[0])
        # (src, dst) -> this process's end of the link: sending, receiving
        self._sends: dict[tuple[int, int], End] = {}
        self._recvs: dict[tuple[int, int], End] = {}
        for s in range(len(self.meshes) - 1):  # the executor's transfers: adjacent stages
            for src, dst in ((s, s + 1), (s + 1, s)):
                if self._backend.owned(self.meshes[src]):
                    self._end(src, dst, src, "send", "")
                if self._backend.owned(self.meshes[dst]):
                    self._end(src, dst, dst, "receive", "")

    def _end(self, src: int, dst: int, here: int, what: str, tag: str) -> End:
        """This process's end (at stage ``here``) of the link from ``src`` to ``dst``."""
        for s in (src, dst):
            if not 0 <= s < len(self.meshes):
                raise ShardingError(
                    f"Pipeline {what} {tag}: stage {s} is not one of the "
                    f"{len(self.meshes)} stages (0..{len(self.meshes) - 1}).")
        mesh = self.meshes[here]
        owned = list(self._backend.owned(mesh))
        if len(owned) != 1:
            holds = ("holds no device" if not owned else
                     f"holds {len(owned)} devices (the transport carries one per process)")
            raise ShardingError(
                f"Pipeline {what} of {tag} between stages {src} and {dst} on rank "
                f"{world_backend().process_index()}, which {holds} of stage {here}'s mesh "
                f"{mesh!r} (devices {[d.id for d in mesh.devices]}): only the stage's "
                "processes send and receive its values.")
        k = owned[0]
        link = self._backend.link(self.meshes[src], self.meshes[dst], k, (src, dst))
        end = (link, k, self._backend.device_of(mesh, k))
        (self._sends if here == src else self._recvs)[(src, dst)] = end
        return end

    def send(self, value: Any, src_stage: int, dst_stage: int, tag: str) -> None:
        """Send ``value`` (a pytree of shardwise Tensors, torch tensors, None, scalars)
        from stage ``src_stage`` (held here) to ``dst_stage``."""
        end = self._sends.get((src_stage, dst_stage))
        if end is None:
            end = self._end(src_stage, dst_stage, src_stage, "send", tag)
        link, k, _ = end
        leaves, text = flatten(value)
        mesh = self.meshes[src_stage]
        metas: list[Any] = []
        blocks: list[torch.Tensor] = []
        for x in leaves:
            meta, block = _part(x, mesh, k)
            metas.append(meta)
            if block is not None:
                blocks.append(block)
        link.send([text, metas], blocks, _key(src_stage, dst_stage, tag))

    def recv(self, src_stage: int, dst_stage: int, tag: str) -> Any:
        """The value stage ``src_stage`` sent to ``dst_stage`` (held here) under ``tag``,
        rebuilt on ``dst_stage``'s mesh."""
        end = self._recvs.get((src_stage, dst_stage))
        if end is None:
            end = self._end(src_stage, dst_stage, dst_stage, "receive", tag)
        link, k, dev = end
        key = _key(src_stage, dst_stage, tag)
        (spec_text, metas), blocks = link.recv(key)
        mesh = self.meshes[dst_stage]
        it = iter(blocks)
        leaves = [_rebuild(m, next(it) if m[0] != "v" else None, mesh, k, key, link, dev)
                  for m in metas]
        return unflatten(leaves, spec_text)

    def flush(self) -> None:
        """Wait until every value this process sent was received (bounded)."""
        self._backend.flush_links()


def _key(src: int, dst: int, tag: str) -> str:
    return f"{tag} from stage {src} to stage {dst}"


def _part(x: Any, mesh: DeviceMesh, k: int) -> tuple[Any, torch.Tensor | None]:
    """A leaf's description for the receiver (JSON) and the tensor that carries it:
    a shardwise Tensor's layout (its dims and Partial ops), global shape and whether it
    records gradients, with its block on device ``k``; a torch tensor's gradient flag,
    with itself; any other value, as it is."""
    if isinstance(x, Tensor):
        if x.mesh != mesh:
            raise ShardingError(
                f"Pipeline send: a Tensor on {x.mesh!r} leaves the stage on {mesh!r}; a stage "
                "sends values on its own mesh (relayout it onto the stage mesh first).")
        block = x.shards[k]
        assert block is not None, "a process holds its own block"
        return _layout_meta(x), block
    if isinstance(x, torch.Tensor):
        return ["t", x.requires_grad], x  # (the link copies its bytes: no autograd involved)
    check_value(x, "Pipeline send")
    return ["v", x], None


def _layout_meta(x: Tensor) -> list[Any]:
    """What the receiver needs besides a shardwise Tensor's block (JSON): its layout's
    dims, Partial ops and sequence orders, its global shape, whether it records
    gradients."""
    lay = x.dist_layout
    return ["sw", [list(d) for d in lay.dims],
            [None if p is None else p.value for p in lay.partial], list(x.shape),
            x.requires_grad, [[o.dim, o.length, o.parts, o.inner] for o in lay.orders]]


def _rebuild(meta: Any, block: Any, mesh: DeviceMesh, k: int, key: str, link: Link,
             dev: torch.device) -> Any:
    if meta[0] == "v":
        return meta[1]
    if meta[0] == "t":
        return block.requires_grad_(True) if meta[1] and _grads(block) else block
    _, dims, partial, shape, grad, orders = meta
    layout = Layout(mesh, tuple(tuple(d) for d in dims),
                    tuple(None if p is None else ReduceOp(p) for p in partial),
                    tuple(SequenceOrder(*o) for o in orders))
    want = local_shape(tuple(shape), layout, mesh.coord_of(k))
    if tuple(block.shape) != want:
        sender = "this rank" if link.peer is None else f"rank {link.peer}"
        raise CollectiveError(
            f"Pipeline receive of {key} on rank {world_backend().process_index()}: {sender} "
            f"sent a block of shape {tuple(block.shape)}, but global shape {tuple(shape)} "
            f"laid out as {layout} puts shape {want} here: the stages' meshes or layouts "
            "disagree.")
    if block.device != dev:  # e.g. NCCL's GPU message for a CPU mesh
        block = block.to(dev)
    if grad and _grads(block):
        block.requires_grad_(True)
    shards: list[torch.Tensor | None] = [None] * mesh.num_devices
    shards[k] = block
    return Tensor(shards, layout, shape, block.dtype)


def _grads(x: torch.Tensor) -> bool:
    return x.dtype.is_floating_point or x.dtype.is_complex
