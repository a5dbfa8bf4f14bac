"""The matmul family on shardwise Tensors: addmm with beta/alpha and its kin (addmv,
addr, baddbmm, addbmm), dot, vdot, mv, outer, inner, tensordot, kron, multi_dot,
``torch._grouped_mm`` (transformers' MoE experts), bilinear, cdist.

Invariants:
- Ops with an addend (addmv, addr, baddbmm, addbmm, addmm with a beta or alpha) keep
  their contracted dims whole, so the addend is added once per output element;
  products without one (dot, mv, outer) leave a Partial(SUM) where the contracted dim
  is sharded. ``torch.addmm`` itself is :func:`shardwise.ops.nn.addmm` (matmul then
  add: a row-parallel contraction stays Partial).
- ``torch._grouped_mm`` (rule ``grouped_mm``): ``offs`` indexes the global grouped dim,
  so it and the groups stay whole. It runs torch's kernel wherever the kernel takes the
  block's strides, else one mm per group (same products); a call torch's kernel would
  refuse on the global value (unaligned rows, a bias, another offs dtype) falls back to
  torch, which decides.
- A tensor ``dims`` of tensordot is no operand of a rule: it falls back (exact values,
  a warning).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops import compute
from shardwise.ops.execute import apply
from shardwise.ops.registry import TensorMethod, fallback, on_mesh, register
from shardwise.sharding.layout import normalize_dim
from shardwise.tensors.tensor import Tensor

__all__ = ["scaled_addmm"]


# --- the matmul family ---------------------------------------------------------------------
def _addmm(func: Any, kind: str) -> Callable[..., Any]:
    def handler(input: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1,
                out: Any = None) -> Any:
        if out is not None or not torch.is_tensor(input) or isinstance(beta, Tensor) or (
                isinstance(alpha, Tensor)):
            return fallback(func, (input, a, b), {"beta": beta, "alpha": alpha, "out": out})
        return apply("addmm", on_mesh([input, a, b]), lambda i, x, y: func(
            i, x, y, beta=beta, alpha=alpha), kind)

    return handler


# torch.addmm itself is nn.addmm's (a sharded contraction stays Partial there, as in a
# row-parallel Conv1D); it comes here only with a beta or alpha
scaled_addmm = _addmm(torch.addmm, "addmm")
_f: Any  # the loops below bind torch functions of several signatures
for _f, _kind in ((torch.addmv, "addmv"), (torch.addr, "addr"),
                  (torch.baddbmm, "baddbmm"), (torch.addbmm, "addbmm")):
    register(_f, getattr(TensorMethod, _f.__name__))(_addmm(_f, _kind))


def _product(rule: str, func: Any, ranks: tuple[int, int]) -> Callable[..., Any]:
    """dot, vdot, mv, outer: their fixed rule; a sharded contracted dim leaves a
    Partial(SUM) (no communication)."""

    def handler(a: Any, b: Any, *, out: Any = None) -> Any:
        if out is not None or not (torch.is_tensor(a) and torch.is_tensor(b)) or (
                a.ndim, b.ndim) != ranks:
            return fallback(func, (a, b), {"out": out} if out is not None else {})
        return apply(rule, on_mesh([a, b]), func)

    return handler


for _f, _rule, _ranks in ((torch.dot, "dot", (1, 1)), (torch.vdot, "dot", (1, 1)),
                          (torch.mv, "mv", (2, 1)), (torch.outer, "outer", (1, 1)),
                          (torch.ger, "outer", (1, 1))):
    register(_f, getattr(TensorMethod, _f.__name__))(_product(_rule, _f, _ranks))

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _contract(func: Any, a: Any, b: Any, pairs: Sequence[tuple[int, int]],
              call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A contraction of ``a``'s and ``b``'s dims in ``pairs`` whose output is a's free
    dims then b's (tensordot, inner): the einsum rule (sharded contracted dims leave
    Partial(SUM))."""
    if a.ndim + b.ndim > len(_LETTERS):
        return fallback(func, args, kwargs)
    la = list(_LETTERS[:a.ndim])
    lb = list(_LETTERS[a.ndim:a.ndim + b.ndim])
    for i, j in pairs:
        if a.shape[i] == b.shape[j]:
            lb[j] = la[i]
        elif 1 not in (a.shape[i], b.shape[j]):
            return fallback(func, args, kwargs)  # torch names the mismatch
        # else a size-1 side broadcasts: each dim summed on its own (no shared letter)
    free_a = [c for d, c in enumerate(la) if d not in {i for i, _ in pairs}]
    free_b = [c for d, c in enumerate(lb) if d not in {j for _, j in pairs}]
    eq = "".join(la) + "," + "".join(lb) + "->" + "".join(free_a + free_b)
    return apply("einsum", on_mesh([a, b]), call, eq)


@register(torch.tensordot, TensorMethod.__dict__.get("tensordot"))
def tensordot(a: Any, b: Any, dims: Any = 2, out: Any = None) -> Any:
    args, kwargs = (a, b), {"dims": dims, **({"out": out} if out is not None else {})}
    if out is not None or not (torch.is_tensor(a) and torch.is_tensor(b)) or torch.is_tensor(dims):
        return fallback(torch.tensordot, args, kwargs)
    if isinstance(dims, int):
        if dims < 0 or dims > min(a.ndim, b.ndim):
            return fallback(torch.tensordot, args, kwargs)
        pairs = [(a.ndim - dims + k, k) for k in range(dims)]
    else:
        da, db = dims
        da = [da] if isinstance(da, int) else list(da)
        db = [db] if isinstance(db, int) else list(db)
        if len(da) != len(db):
            return fallback(torch.tensordot, args, kwargs)
        pairs = [(normalize_dim(i, max(a.ndim, 1)), normalize_dim(j, max(b.ndim, 1)))
                 for i, j in zip(da, db)]
    return _contract(torch.tensordot, a, b, pairs,
                     lambda x, y: torch.tensordot(x, y, dims), args, kwargs)


@register(torch.inner, TensorMethod.inner)
def inner(a: Any, b: Any, *, out: Any = None) -> Any:
    args, kwargs = (a, b), ({"out": out} if out is not None else {})
    if out is not None or not (torch.is_tensor(a) and torch.is_tensor(b)):
        return fallback(torch.inner, args, kwargs)
    if a.ndim == 0 or b.ndim == 0:  # torch's inner is then a product
        return compute.mul(*on_mesh([a, b]))
    return _contract(torch.inner, a, b, [(a.ndim - 1, b.ndim - 1)], torch.inner, args,
                     kwargs)


@register(torch.kron, TensorMethod.kron)
def kron(a: Any, b: Any, *, out: Any = None) -> Any:
    if out is not None or not (torch.is_tensor(a) and torch.is_tensor(b)):
        return fallback(torch.kron, (a, b), {"out": out} if out is not None else {})
    return apply("kron", on_mesh([a, b]), torch.kron)


@register(torch.linalg.multi_dot)
def multi_dot(tensors: Sequence[Any], *, out: Any = None) -> Any:
    ts = list(tensors)
    if out is not None or len(ts) < 2 or not all(torch.is_tensor(t) for t in ts) or any(
            t.ndim not in (1, 2) for t in ts) or any(t.ndim != 2 for t in ts[1:-1]):
        return fallback(torch.linalg.multi_dot, (tensors,), {"out": out} if out is not None
                        else {})
    return apply("multi_dot", on_mesh(ts), lambda *xs: torch.linalg.multi_dot(xs))


def _kernel_takes(m: torch.Tensor) -> bool:
    """Whether torch's grouped_mm kernel takes ``m`` (its stride check, as in ATen's
    GroupedMMUtils): row- or column-major last two dims, the other stride a multiple
    of 16 bytes."""
    align = max(16 // m.element_size(), 1)
    (r, c), (sr, sc) = m.shape[-2:], m.stride()[-2:]
    if sc == 1 and sr >= max(1, c):
        return sr % align == 0
    if sr == 1 and sc >= max(1, r):
        return sc % align == 0
    return False


def _grouped_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """torch._grouped_mm as one mm per group (autograd through the loop): for blocks
    the kernel refuses. Rows past ``offs[-1]``, which torch leaves unwritten, are 0."""
    if offs is None:
        return torch.bmm(a, b)
    ends = [int(e) for e in offs.tolist()]
    starts = [0, *ends[:-1]]
    grouped = b.shape[0] if a.ndim == 2 and b.ndim == 2 else (
        a.shape[0] if a.ndim == 2 else b.shape[-1])
    if any(e < s for s, e in zip(starts, ends)) or (ends and ends[-1] > grouped):
        raise ValueError(f"offs {ends} must increase and end within the {grouped} "
                         "grouped rows or columns; give the cumulative group sizes.")
    if a.ndim == 2 and b.ndim == 2:  # (K, M) x (M, N): one (K, N) per group
        return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])
    if a.ndim == 2:  # (M, K) x (G, K, N): rows of a by group
        parts = [a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))]
        parts.append(a.new_zeros((a.shape[0] - ends[-1], b.shape[-1])))
        return torch.cat(parts, 0)
    # (G, M, K) x (K, N): columns of b by group
    parts = [a[g] @ b[:, s:e] for g, (s, e) in enumerate(zip(starts, ends))]
    parts.append(a.new_zeros((a.shape[1], b.shape[-1] - ends[-1])))
    return torch.cat(parts, 1)


@register(torch._grouped_mm)
def grouped_mm(mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None,
               out_dtype: Any = None) -> Any:
    """torch._grouped_mm (transformers' MoE experts) on rule ``grouped_mm``: groups
    whole, N shards with ``mat_b``'s last dim, a sharded K leaves Partial(SUM). A
    block whose strides torch's CPU kernel refuses (a shard of an aligned dim need
    not be aligned) runs one mm per group instead: the same products, allclose."""
    args, kwargs = (mat_a, mat_b), {"offs": offs, "bias": bias, "out_dtype": out_dtype}
    ts = [mat_a, mat_b] + ([offs] if offs is not None else [])
    if bias is not None or out_dtype is not None or not all(torch.is_tensor(t) for t in ts) or (
            (mat_a.ndim, mat_b.ndim) not in ((2, 3), (3, 3), (2, 2), (3, 2))) or (
            (offs is None) != (mat_a.ndim == mat_b.ndim == 3)) or (
            offs is not None and (offs.ndim != 1 or offs.dtype != torch.int32)) or (
            mat_a.dtype != mat_b.dtype or not mat_a.dtype.is_floating_point):
        return fallback(torch._grouped_mm, args, kwargs)  # torch's own checks and errors
    align = max(16 // mat_a.dtype.itemsize, 1)
    if mat_a.shape[-1] % align or mat_b.shape[-1] % align:
        # torch's kernel refuses such rows globally (contiguous): torch decides
        return fallback(torch._grouped_mm, args, kwargs)

    def call(a: torch.Tensor, b: torch.Tensor, o: torch.Tensor | None = None
             ) -> torch.Tensor:
        # the kernel's backward also takes the output's gradient, (.., N) contiguous
        if _kernel_takes(a) and _kernel_takes(b) and b.shape[-1] % align == 0:
            try:
                return torch._grouped_mm(a, b, offs=o)
            except RuntimeError:  # another check of the kernel's, on this block
                pass
        return _grouped_loop(a, b, o)

    return apply("grouped_mm", on_mesh(ts), call)


@register(F.bilinear)
def bilinear(x1: Any, x2: Any, weight: Any, bias: Any = None) -> Any:
    ops = [x1, x2, weight] + ([bias] if bias is not None else [])
    if not all(torch.is_tensor(t) for t in ops) or x1.ndim < 1 or x2.ndim < 1 or weight.ndim != 3:
        return fallback(F.bilinear, (x1, x2, weight, bias), {})
    return apply("bilinear" if bias is None else "bilinear_bias", on_mesh(ops),
                 lambda *xs: F.bilinear(*xs))


@register(torch.cdist)
def cdist(x1: Any, x2: Any, p: float = 2.0, compute_mode: Any = None) -> Any:
    if not (torch.is_tensor(x1) and torch.is_tensor(x2)) or x1.ndim < 2 or x2.ndim < 2:
        return fallback(torch.cdist, (x1, x2, p, compute_mode), {})
    return apply("cdist", on_mesh([x1, x2]), lambda a, b: torch.cdist(a, b, p, compute_mode))
