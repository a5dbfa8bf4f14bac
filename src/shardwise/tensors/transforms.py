"""torch.func's transforms over shardwise Tensors: which transform is running, and the
aten ops it runs below ``__torch_function__`` (on the gathered values, exact).

Invariants:
- Under a transform an aten op on a shardwise Tensor runs through the registry's
  gathered fallback; its results are plain global values, except views, which stay
  Replicated Tensors (a write through them is refused, as any write in place is).
- A Tensor whose values are a transform's own wrapped tensors (it crossed out of the
  transform) is refused, naming the fix.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
import torch.utils._pytree as pytree

from shardwise.sharding.errors import ShardingError
from shardwise.tensors.routing import FALLBACK, REGISTRY

__all__ = ["functorch_caller", "refuse_wrapped", "under_transform"]

#: torch.func's transforms, by the frame that runs the user's function under them
_TRANSFORMS = {"grad_and_value_impl": "grad", "vmap_impl": "vmap", "_vjp_with_argnums": "vjp",
               "_jvp_with_argnums": "jvp", "_jacfwd": "jacfwd"}


def functorch_caller() -> str | None:
    """The outermost torch.func transform on the call stack, if any (jacrev shows as the
    vjp it runs; ``"transform"`` for another torch._functorch frame, such as the
    function that ``vjp`` returns)."""
    found = None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("torch._functorch"):
            found = _TRANSFORMS.get(frame.f_code.co_name, found or "transform")
        frame = frame.f_back  # type: ignore[assignment]
    return found


def under_transform(tensor_type: type, transform: str, func: Any, args: Any,
                    kwargs: dict[str, Any]) -> Any:
    """An aten op that a torch.func transform ran on shardwise Tensors: the registry's
    gathered fallback (values exact, the fallback warning; an error under
    ``shardwise.strict()``), returning the plain global values, except views, which
    stay Replicated Tensors. The transform wraps the results again, so gradients and
    batching are torch's own. Refused: writes in place into a shardwise Tensor (into a
    gathered copy they would be lost), and a Tensor whose values are a transform's
    wrapped tensors (made inside it from plain inputs or dual tangents: it crossed out
    of the transform, which cannot see into it to unwrap them)."""
    if func._schema.is_mutable:
        raise ShardingError(
            f"torch.func ({transform}) ran {func}, which writes in place, on a "
            "shardwise.Tensor: under a torch.func transform an op reaches a "
            "shardwise.Tensor below __torch_function__, where it runs on a gathered "
            "copy, and a write into a copy would be lost. Write out of place inside the "
            "transformed function, or use shardwise.grad / vjp / jvp.")
    refuse_wrapped(tensor_type, f"torch.func ({transform})", func, args, kwargs)
    if not FALLBACK:
        importlib.import_module(REGISTRY)
    # A result that aliases an input (a view) stays a Tensor (a Replicated copy), so a
    # write through it is refused as above; any other result is the plain global value,
    # and what the transform does with it next is torch's alone (torch's composite ops
    # write in place into their fresh results, e.g. matmul's squeeze_ under vmap).
    aliases = any(r.alias_info is not None for r in func._schema.returns)
    return FALLBACK[0](func, tuple(args), kwargs, plain=not aliases)


def refuse_wrapped(tensor_type: type, who: str, func: Any, args: Any,
                   kwargs: dict[str, Any]) -> None:
    """Refuse a ``tensor_type`` operand whose values are a transform's wrapped tensors."""
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, tensor_type) and _wrapped(t):
            raise ShardingError(
                f"{who} met {t!r}, whose values are a transform's own wrapped tensors "
                f"({func}): it was made inside a transformed function (from a plain or "
                "transformed input mixed with shardwise Tensors the transform does not see, "
                "or by jvp's dual tangents, as in jacfwd / hessian) and crossed out of it, "
                "and the transform cannot see into a shardwise.Tensor to unwrap them. "
                "Return x.to_torch() (a plain tensor) from the function, pass every "
                "shardwise.Tensor it uses through the transform (torch.func.functional_call "
                "for a module's parameters), or use shardwise.grad / vjp / jvp.")


def _wrapped(t: Any) -> bool:
    value = t._local.first()
    return value is not None and torch._C._functorch.is_functorch_wrapped_tensor(value)
