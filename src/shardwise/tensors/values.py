"""A shardwise Tensor's values out: the global value (``to_torch``, ``numpy``,
``tolist``, ``item``), a torch ``DTensor``, the storage checkpoint writers compare, and
``torch.distributed.checkpoint``'s hooks (the blocks as chunks with global offsets).

:class:`ValuesMixin` is a base of :class:`shardwise.tensors.tensor.Tensor`.

Invariants:
- A value out never aliases the shards: ``to_torch`` copies where the gathered value
  would share a buffer with them, ``numpy`` always copies.
- Checkpoint chunks and DTensors read the blocks in natural order (one offset per dim):
  a value held in a sequence order is relaid out first.
"""

from __future__ import annotations

from typing import Any, Self

import torch

from shardwise.sharding.layout import Layout
from shardwise.tensors import cache, chunks, dtensor
from shardwise.tensors.compiled import COMPILER
from shardwise.tensors.relayout import RelayoutMixin

__all__ = ["ValuesMixin"]


class ValuesMixin(RelayoutMixin):
    """The global value and the checkpoint hooks (module doc)."""

    def untyped_storage(self) -> torch.UntypedStorage:
        """The storage of what this process holds of the value: its whole value, else
        its first local block (DTensor answers with its local tensor's). Two Tensors
        share one exactly when they share data (tied weights), which is what checkpoint
        writers (safetensors, transformers' ``save_pretrained``) ask it to tell."""
        if COMPILER._is_compiling_flag:  # torch describing the wrapper: none of its own
            return torch.Tensor.untyped_storage(self)  # type: ignore[arg-type]
        first = self._local.first()
        assert first is not None, "this process holds none of the value"
        return first.untyped_storage()

    # --- torch.distributed.checkpoint: the blocks as chunks with global offsets --------
    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        x = self._natural()
        return chunks.write_items(fqn, x._shards, x._layout, x._shape, x._dtype)

    def __create_chunk_list__(self) -> list[Any]:
        x = self._natural()
        return chunks.chunk_list(x._shards, x._layout, x._shape)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        x = self._natural()
        return chunks.tensor_shard(x._shards, x._layout, x._shape, index)

    def _natural(self) -> Self:
        """This value with its blocks in natural order: the chunks and DTensors others
        read have one offset per dim (a relayout where it is held in a sequence order)."""
        return self.relayout(self._layout.with_orders(())) if self._layout.orders else self

    def to_dtensor(self) -> Any:
        """This value as a torch ``DTensor`` on the same processes and placements (no
        copy where the uneven-split conventions agree); process meshes only."""
        return dtensor.to_dtensor(self._natural())

    # --- values -------------------------------------------------------------------------
    def to_torch(self) -> torch.Tensor:
        """The global value as a new torch tensor (Partial axes reduced), on the
        first device of the mesh. Differentiable."""
        out = self.global_value()
        try:
            storages = {s.untyped_storage()._cdata for s in self._local.buffers()}
            alias = out.untyped_storage()._cdata in storages
        except NotImplementedError:  # torch.func's wrappers hide their storage: copy
            alias = True
        return out.clone() if alias else out

    def numpy(self, *, force: bool = False) -> Any:
        # torch's rules (grad, device), then always a gathered copy: the array never
        # shares memory with the shards
        if not force and self._local.requires_grad:
            raise RuntimeError(
                "Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() "
                "instead (or numpy(force=True)).")
        if not force and self.device.type != "cpu":
            raise TypeError(
                f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() "
                "to copy the tensor to host memory first (or numpy(force=True)).")
        return self.to_torch().detach().cpu().numpy()

    def tolist(self) -> Any:
        return self.to_torch().tolist()

    def item(self) -> Any:
        # through the kept relayout: ``loss.item()`` then ``loss.backward()`` reduce once
        full = cache.relayout(self, Layout.replicated(self.mesh, self.ndim))
        return full._local.global_value(full._layout, full._shape, full._dtype).item()
