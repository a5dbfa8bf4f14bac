"""One all_gather and one reduce_scatter for all the parameters of a ``fully_shard``
unit (of one dtype), as FSDP2 batches them: the flat buffer.

Invariants:
- Each device's flat block is its sharded blocks of the group's parameters, flattened
  end to end in parameter order and zero-padded to one length ``L`` (the longest
  device's), so every device sends and receives alike.
- The flat buffer is a global (M, n*L) value: dim 0 Sharded over the mesh axes other
  than the FSDP axis (mesh order; M their product), dim 1 over the FSDP axis (n its
  size). Gathering dim 1 is exactly one all_gather over the FSDP axis; reducing a
  Partial(SUM) over it into dim 1 is exactly one reduce_scatter.
- Only parameters whose gathered block is the concatenation of the FSDP peers'
  sharded blocks along the FSDP dim (the planner gathers them with one all_gather)
  join a group; the gathered blocks are copies (the flat buffer dies after the split),
  and devices that are replicas in a parameter's gathered layout share one block.
- Where the unit's parameters hold whole values (a mesh this process holds wholly)
  no flat buffer is built: :meth:`Flat.gather_plan` and :meth:`Flat.plan` give the
  collectives to count (see :mod:`~shardwise.parallel.fsdp_unit`).
"""

from __future__ import annotations

import math

import torch

from shardwise.planner import Plan, make_plan
from shardwise.sharding.layout import Layout
from shardwise.sharding.mesh import DeviceMesh
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import local_shape
from shardwise.tensors.tensor import Tensor

__all__ = ["Flat", "one_all_gather"]

Blocks = list  # list[torch.Tensor | None], one entry per mesh device


def one_all_gather(sharded: Layout, gathered: Layout, shape: tuple[int, ...],
                   axis: int) -> bool:
    """Whether the planner takes ``sharded`` to ``gathered`` with one all_gather over
    mesh ``axis`` (and nothing else that communicates)."""
    steps = make_plan(sharded, gathered, shape, 4).collectives
    return [(s.kind, s.axes) for s in steps] == [("all_gather", (axis,))]


class Flat:
    """The flat buffer of some parameters (global ``shapes``, sharded and gathered
    layouts, FSDP ``dims``) over mesh ``axis``.

    >>> mesh = DeviceMesh.cpu(2, "dp")
    >>> rows = Layout(mesh, ((0,), ()), (None,))
    >>> flat = Flat(mesh, 0, [((3, 2), rows, Layout.replicated(mesh, 2), 0)])
    >>> flat.length, flat.layout("sharded")      # 2 rows of 2 on device 0, 1 on device 1
    (4, Layout(mesh=DeviceMesh(dp=2), dims=((), (0,)), partial=(None,)))
    """

    def __init__(self, mesh: DeviceMesh, axis: int,
                 params: list[tuple[tuple[int, ...], Layout, Layout, int]]) -> None:
        self.mesh, self.axis, self.params = mesh, axis, params
        self.n = mesh.shape[axis]
        others = tuple(a for a in range(mesh.ndim) if a != axis)
        self.rows = math.prod(mesh.shape[a] for a in others)
        # per device, per parameter: the sharded block's shape and its offset (shared,
        # read-only lists: devices whose coordinates agree on the axes the layouts
        # split over hold equal blocks, so a mesh of thousands computes a few)
        split = sorted({a for _, ls, _, _ in params for axes in ls.dims for a in axes})
        memo: dict[tuple[int, ...], tuple[list[tuple[int, ...]], list[int]]] = {}
        self.shapes: list[list[tuple[int, ...]]] = []
        self.offsets: list[list[int]] = []
        for k in range(mesh.num_devices):
            coord = mesh.coord_of(k)
            key = tuple(coord[a] for a in split)
            hit = memo.get(key)
            if hit is None:
                shapes = [tuple(local_shape(s, ls, coord)) for s, ls, _, _ in params]
                at, offs = 0, []
                for shape in shapes:
                    offs.append(at)
                    at += math.prod(shape)
                hit = memo[key] = (shapes, [*offs, at])
            self.shapes.append(hit[0])
            self.offsets.append(hit[1])
        self.length = max(offs[-1] for offs in self.offsets)
        # per device: the devices along ``axis`` through it, in order (row-major flat
        # indices: a step of ``axis`` moves the index by the product of the later sizes)
        stride = math.prod(mesh.shape[a] for a in range(axis + 1, mesh.ndim))
        self.peers: list[list[int]] = []
        for k in range(mesh.num_devices):
            base = k - mesh.coord_of(k)[axis] * stride
            self.peers.append([base + j * stride for j in range(self.n)])
        none = (None,) * mesh.ndim
        self._layouts = {
            "sharded": Layout(mesh, (others, (axis,)), none),
            "gathered": Layout(mesh, (others, ()), none),
            "reduced": Layout(mesh, (others, ()), tuple(
                ReduceOp.SUM if a == axis else None for a in range(mesh.ndim))),
        }
        self.shape = (self.rows, self.n * self.length)

    def layout(self, which: str) -> Layout:
        return self._layouts[which]

    def gather_plan(self, itemsize: int) -> Plan:
        """The all_gather of the parameters (for counting where none runs)."""
        return make_plan(self._layouts["sharded"], self._layouts["gathered"], self.shape,
                         itemsize)

    def plan(self, itemsize: int) -> Plan:
        """The reduce_scatter of the gradients (for counting where autograd summed)."""
        return make_plan(self._layouts["reduced"], self._layouts["sharded"], self.shape,
                         itemsize)

    def gather(self, values: list[Tensor], owned: list[int]) -> list[Blocks]:
        """Per parameter, per device: the gathered block (None where not ``owned``)."""
        dtype = values[0].dtype
        rows: Blocks = [None] * self.mesh.num_devices
        memo: dict[tuple[int, ...], torch.Tensor] = {}
        for k in owned:
            parts = [v.shards[k] for v in values]
            key = tuple(map(id, parts))
            row = memo.get(key)
            if row is None:
                pad = self.length - self.offsets[k][-1]
                flat = [p.reshape(-1) for p in parts]
                if pad:
                    flat.append(parts[0].new_zeros(pad))
                row = memo[key] = torch.cat(flat).view(1, self.length)
            rows[k] = row
        whole = Tensor(rows, self._layouts["sharded"], self.shape, dtype).relayout(
            self._layouts["gathered"])
        out: list[Blocks] = []
        for i, (_, _, lg, dim) in enumerate(self.params):
            reps = lg.representatives()
            blocks: Blocks = [None] * self.mesh.num_devices
            for k in owned:
                if reps[k] != k and blocks[reps[k]] is not None:
                    blocks[k] = blocks[reps[k]]
                    continue
                row = whole.shards[k].view(-1)
                pieces = []
                for j, peer in enumerate(self.peers[k]):
                    start = j * self.length + self.offsets[peer][i]
                    shape = self.shapes[peer][i]
                    pieces.append(row[start:start + math.prod(shape)].view(shape))
                blocks[k] = torch.cat(pieces, dim)
            out.append(blocks)
        return out

    def scatter(self, grads: list[Blocks], dtype: torch.dtype, owned: list[int]
                ) -> list[Blocks]:
        """Per parameter, per device: the sum over ``axis`` of the gathered-layout
        gradient shares ``grads``, cut to the device's sharded block."""
        rows: Blocks = [None] * self.mesh.num_devices
        device = next((g.device for gs in grads for g in gs if g is not None), None)
        for k in owned:
            cuts = []
            for i, (_, _, _, dim) in enumerate(self.params):
                sizes = [self.shapes[peer][i][dim] for peer in self.peers[k]]
                g = grads[i][k]
                if g is None:
                    whole = list(self.shapes[k][i])
                    whole[dim] = sum(sizes)
                    g = torch.zeros(whole, dtype=dtype, device=device)
                cuts.append(g.to(dtype).split(sizes, dim))
            flat: list[torch.Tensor] = []
            for j, peer in enumerate(self.peers[k]):
                flat.extend(c[j].reshape(-1) for c in cuts)
                pad = self.length - self.offsets[peer][-1]
                if pad:
                    flat.append(torch.zeros(pad, dtype=dtype, device=device))
            rows[k] = torch.cat(flat).view(1, self.n * self.length)
        summed = Tensor(rows, self._layouts["reduced"], self.shape, dtype).relayout(
            self._layouts["sharded"])
        out: list[Blocks] = []
        for i in range(len(self.params)):
            blocks: Blocks = [None] * self.mesh.num_devices
            for k in owned:
                row = summed.shards[k].view(-1)
                start, shape = self.offsets[k][i], self.shapes[k][i]
                blocks[k] = row[start:start + math.prod(shape)].view(shape)
            out.append(blocks)
        return out

