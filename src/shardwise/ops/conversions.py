"""dtype conversions, copies and dtype queries on shardwise Tensors: ``x.to(dtype)``,
``x.float()``, ``x.type(...)``, ``clone``, ``contiguous``, ``conj``.

Invariants:
- A conversion keeps the layout: dtype casts run per block (or once on the whole
  value), and a cast to the tensor's own dtype returns the tensor itself, as torch does.
- A shardwise Tensor never changes torch device behind its mesh: ``.to(device)``
  other than the shards' raises and names ``shardwise.to_device``.
- Queries (``x.type()``, ``torch.is_complex``, nn.Module's shallow-copy check) are
  answered from the wrapper's metadata, never by gathering values.
"""

from __future__ import annotations

import pydoc
from collections.abc import Callable
from typing import Any

import torch

from shardwise.ops.execute import apply
from shardwise.ops.registry import TensorMethod, register
from shardwise.sharding.errors import ShardingError, ShardingTypeError

__all__ = ["to"]


@register(TensorMethod.to)
def to(x: Any, *args: Any, **kwargs: Any) -> Any:
    """``x.to(dtype)`` / ``.to(device)`` / ``.to(other)``: dtype casts per block; the
    torch device must already be the shards' (move meshes with shardwise.to_device)."""
    dtype = kwargs.pop("dtype", None)
    device = kwargs.pop("device", None)
    kwargs.pop("non_blocking", None)
    kwargs.pop("copy", None)
    kwargs.pop("memory_format", None)
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.Tensor):
            dtype, device = a.dtype, a.device
    if device is not None and torch.device(device) != x.device:
        raise ShardingError(
            f"{x!r} lives on {x.device} shards; .to({device!r}) would move a distributed "
            "tensor's shards behind its mesh. Use shardwise.to_device(x, sharding=...) to "
            "move it to a mesh of other devices."
        )
    if dtype is None or dtype == x.dtype:
        return x
    return apply("to", (x,), lambda s: s.to(dtype))


def _cast(dtype: torch.dtype) -> Callable[..., Any]:
    """``x.float()`` and kin: ``x.to(dtype)`` (their memory_format= is moot here)."""

    def cast(x: Any, *args: Any, **kwargs: Any) -> Any:
        return to(x, dtype)

    return cast


for _name, _dtype in (("float", torch.float32), ("double", torch.float64),
                      ("half", torch.float16), ("bfloat16", torch.bfloat16),
                      ("int", torch.int32), ("long", torch.int64), ("bool", torch.bool),
                      # issue 20 (helper ew): the other casts of torch.Tensor
                      ("byte", torch.uint8), ("char", torch.int8), ("short", torch.int16),
                      ("cfloat", torch.complex64), ("cdouble", torch.complex128),
                      ("chalf", torch.complex32)):
    register(getattr(TensorMethod, _name))(_cast(_dtype))


# dtype queries the optimizers make per parameter and step: answered directly
@register(torch.is_complex)
def is_complex(x: Any) -> bool:
    return x.dtype.is_complex


@register(torch.is_floating_point)
def is_floating_point(x: Any) -> bool:
    return x.dtype.is_floating_point


@register(TensorMethod.type_as)
def type_as(x: Any, other: Any) -> Any:
    return to(x, other.dtype)


@register(TensorMethod.type)
def type_(x: Any, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    # torch.typename and nn.Module's error messages call x.type(): answered from the
    # dtype, never by gathering the values
    if dtype is None:
        return torch.empty(0, dtype=x.dtype, device=x.device).type()
    if isinstance(dtype, str):  # "torch.DoubleTensor", "torch.cuda.HalfTensor"
        cls = pydoc.locate(dtype)
        target = getattr(cls, "dtype", None)
        if not isinstance(target, torch.dtype):
            raise ShardingTypeError(
                f"{x!r}.type({dtype!r}): {dtype!r} names no tensor type; pass a "
                "torch.dtype or a name like 'torch.DoubleTensor'.")
        cuda = bool(getattr(cls, "is_cuda", False))  # the name says cpu or cuda only
        same = cuda == (x.device.type == "cuda")
        return to(x, target, x.device if same else ("cuda" if cuda else "cpu"))
    return to(x, dtype)


# nn.Module._apply asks it per parameter (module.to(dtype)); wrappers and their
# shards are plain TensorImpls, so the answer is torch's on the wrappers themselves
@register(torch._has_compatible_shallow_copy_type)
def compatible_shallow_copy(a: Any, b: Any) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return bool(torch._has_compatible_shallow_copy_type(a, b))


@register(torch.clone, TensorMethod.clone)
def clone(x: Any, memory_format: Any = None) -> Any:
    return apply("clone", (x,), torch.clone)


@register(TensorMethod.contiguous)
def contiguous(x: Any, memory_format: Any = None) -> Any:
    if all(b.is_contiguous() for b in x.held.buffers()):
        return x
    return x.map_buffers(lambda s: s.contiguous())


@register(TensorMethod.cpu)
def cpu(x: Any, *args: Any, **kwargs: Any) -> Any:
    return to(x, "cpu")


@register(TensorMethod.conj, torch.conj, TensorMethod.resolve_conj, torch.resolve_conj,
          TensorMethod.resolve_neg, torch.resolve_neg)
def conj(x: Any) -> Any:
    if x.is_complex():
        return x.map_blocks(torch.conj)
    return x
