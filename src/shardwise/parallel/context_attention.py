"""Attention over a context-parallel axis: ring and all-to-all (Ulysses), per device.

``attend(q, k, v, ...)`` runs ``F.scaled_dot_product_attention`` on q/k/v whose
sequence dim (-2) is Sharded over the ``cp`` mesh axis, through ``shard_map`` (the
same per-device code on the simulated mesh and under torchrun), and returns the
output laid out as q is. The other mesh axes keep what q has (batch over ``dp``,
heads over ``tp``).

Invariants:
- The sequence is in the region's order (:func:`sequence_order`): device ``r`` holds
  the contiguous CP-order block ``split_bounds(L, cp, r)``, whose natural positions
  ``order[block]`` decide causality; masks are given in the same order.
- Ring: the KV block (k and v in one tensor) travels ``cp - 1`` hops of
  ``lax.ppermute`` (device ``r`` sends to ``r + 1``); each device attends its queries
  to every block with an online softmax whose running max and sum (the logsumexp,
  ``m + log l``) stay in float32 (float64 for float64 inputs). A block whose every
  (query, key) pair is masked is skipped (no compute; the block still travels on).
  Its gradient is autograd's: the reverse rotation of dK/dV (ppermute's transpose).
- All-to-all: q, k, v go from sequence-sharded to head-sharded over ``cp`` (one
  ``lax.all_to_all`` each), torch's own attention runs on the whole sequence in
  natural order, and the output goes back (a fourth): 4 exchanges. GQA's kv heads
  travel as they are when they divide by ``cp``, else each is repeated the fewest
  times that makes them divide.
- Fully masked query rows give 0, as torch's attention does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.sharding.layout import Layout
from shardwise.sharding.orders import sequence_order
from shardwise.sharding.shapes import split_bounds
from shardwise.spmd import lax
from shardwise.spmd.shard_map import shard_map

__all__ = ["Attention", "attend", "sequence_order"]


@dataclass(frozen=True)
class Attention:
    """What one context-parallel attention call needs besides its tensors (static on
    every device): the cp axis, the method, the order, the call's arguments."""

    axis: str
    method: str
    balanced: bool
    causal: bool
    scale: float | None
    groups: int          # query heads per kv head (GQA), 1 without
    mask: str | None     # None, "bool" or "float"


def attend(setting: Attention, q: Any, k: Any, v: Any, mask: Any,
           layouts: Sequence[Layout]) -> Any:
    """The attention output (a Tensor laid out as ``layouts[0]``) of q, k, v (and the
    mask) laid out as ``layouts``; see the module doc."""
    args = (q, k, v) + ((mask,) if mask is not None else ())
    mesh = layouts[0].mesh
    n = mesh.axis_size(setting.axis)
    lengths = (q.shape[-2], k.shape[-2])
    body = functools.partial(_ring if setting.method == "ring" else _all_to_all,
                             setting, n, lengths)
    run = shard_map(body, mesh, in_specs=tuple(layouts[:len(args)]), out_specs=layouts[0],
                    check_writes=False)
    return run(*args)


def _positions(length: int, n: int, balanced: bool, r: int) -> torch.Tensor:
    start, stop = split_bounds(length, n, r)
    return torch.tensor(sequence_order(length, n, balanced)[start:stop], dtype=torch.long)


@functools.lru_cache(maxsize=1024)
def runs(length: int, n: int, balanced: bool, r: int) -> tuple[tuple[int, int, int], ...]:
    """Device ``r``'s block as runs of consecutive natural positions: ``(first row,
    stop row, first position)`` each (a head and a tail piece when balanced).

    >>> runs(8, 2, True, 0), runs(7, 2, False, 1)
    (((0, 2, 0), (2, 4, 6)), ((0, 3, 4),))
    """
    order = sequence_order(length, n, balanced)
    start, stop = split_bounds(length, n, r)
    out: list[tuple[int, int, int]] = []
    for i in range(start, stop):
        if out and order[i] == order[i - 1] + 1:
            out[-1] = (out[-1][0], i - start + 1, out[-1][2])
        else:
            out.append((i - start, i - start + 1, order[i]))
    return tuple(out)


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype == torch.float64 else torch.float32


# --- ring -----------------------------------------------------------------------------------
Part = tuple[slice, slice, bool, torch.Tensor | None]
"""A rectangle of a block to attend: query rows, key columns, causal (square, on the
diagonal), an additive mask (or None: every pair attends)."""


def _ring(setting: Attention, n: int, lengths: tuple[int, int], q: torch.Tensor,
          k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
    """One device's ring attention: its queries against every KV block in turn."""
    r = lax.axis_index(setting.axis)
    scale = 1 / math.sqrt(q.shape[-1]) if setting.scale is None else setting.scale
    split = k.shape[-1]
    kv = torch.cat([k, v], -1)  # one exchange per hop carries both
    blocks: list[tuple[torch.Tensor, torch.Tensor, list[Part]]] = []
    ring = [(j, (j + 1) % n) for j in range(n)]
    for hop in range(n):
        if hop:
            kv = lax.ppermute(kv, setting.axis, ring)
        src = (r - hop) % n
        start, stop = split_bounds(lengths[1], n, src)
        block_mask = mask[0][..., start:stop] if mask else None
        parts = [] if stop == start or q.shape[-2] == 0 else _parts(
            setting, n, lengths, r, src, block_mask, q)
        if parts:  # else every pair of this block is masked: nothing to add
            kb, vb = kv.split([split, kv.shape[-1] - split], -1)
            blocks.append((kb, vb, parts))
    if not blocks:
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    elif _fused(q, v):
        flat = [t for kb, vb, _ in blocks for t in (kb, vb)]
        out = _Blocks.apply(q, scale, [parts for _, _, parts in blocks], *flat)
    else:
        out = _math_blocks(q, blocks, scale, setting.groups)
    if n > 1 and kv.requires_grad and torch.is_grad_enabled():
        # the last block may have been skipped here and used elsewhere: keep it in the
        # graph (zero gradient) so every device runs the same reverse rotations
        out = _Keep.apply(out, kv)
    return out


def _parts(setting: Attention, n: int, lengths: tuple[int, int], r: int, src: int,
           mask: torch.Tensor | None, q: torch.Tensor) -> list[Part]:
    """The rectangles of the block (queries of ``r``, keys of ``src``) to attend. Causal:
    each pair of position runs is skipped (every key after every query), whole (every
    key before), the diagonal (the same run: causal) or cut by a mask (uneven runs);
    otherwise the whole block with its mask (none if a boolean mask allows nothing)."""
    whole = slice(None)
    if not setting.causal:
        if mask is None:
            return [(whole, whole, False, None)]
        if mask.dtype == torch.bool and not bool(mask.any()):
            return []
        return [(whole, whole, False, _additive(mask, q))]
    parts: list[Part] = []
    for qa, qb, qn in runs(lengths[0], n, setting.balanced, r):
        for ka, kb, kn in runs(lengths[1], n, setting.balanced, src):
            last_q, last_k = qn + qb - qa - 1, kn + kb - ka - 1
            if kn > last_q:
                continue
            rows, cols = slice(qa, qb), slice(ka, kb)
            if last_k <= qn:
                parts.append((rows, cols, False, None))
            elif kn == qn and last_k == last_q:
                parts.append((rows, cols, True, None))
            else:  # runs of different lengths overlapping (uneven blocks)
                allowed = (torch.arange(kn, last_k + 1)[None, :]
                           <= torch.arange(qn, last_q + 1)[:, None])
                parts.append((rows, cols, False, _additive(allowed, q)))
    return parts


def _additive(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A boolean or float mask as an additive one of q's dtype (0 or -inf where boolean),
    with 2 or 4 dims where q has 4 (the fused kernel's rule)."""
    out = (torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
           if mask.dtype == torch.bool else mask.to(q.dtype))
    if out.ndim in (1, 3) and q.ndim == 4:
        out = out.reshape((1,) * (4 - out.ndim) + tuple(out.shape))
    return out


class _Keep(torch.autograd.Function):
    """``out`` unchanged forward; ``kept`` gets a zero gradient backward."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        ctx.like = (kept.shape, kept.dtype, kept.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.like
        return grad, torch.zeros(shape, dtype=dtype, device=device)


_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _fused(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's fused CPU kernel runs the blocks: 4-D CPU tensors whose value
    head size is the query's (the kernel's conditions)."""
    return (q.ndim == 4 and q.device.type == "cpu" and q.dtype in _FUSED_DTYPES
            and v.shape[-1] == q.shape[-1])


class _Blocks(torch.autograd.Function):
    """q attended to every KV block's parts with torch's fused CPU kernel: forward
    merges the parts' outputs by their logsumexp (float32 or wider); backward runs the
    kernel's backward per part against the merged output and logsumexp (the
    ring-attention backward), so each block's dk, dv flow back through the rotations."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, scale: float, plan: list[list[Part]],
                *kvs: torch.Tensor) -> torch.Tensor:
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        acc = _accumulator(q.dtype)
        total = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        done = []
        for i, parts in enumerate(plan):
            k, v = kvs[2 * i], kvs[2 * i + 1]
            for rows, cols, causal, m in parts:
                o, lse = kernel(q[..., rows, :], k[..., cols, :], v[..., cols, :], 0.0,
                                causal, attn_mask=m, scale=scale)
                if m is not None:  # the kernel gives a row masked everywhere lse 0
                    lse = lse.masked_fill(torch.isneginf(m).all(-1), float("-inf"))
                lse = lse.to(acc)
                total[..., rows] = torch.logaddexp(total[..., rows], lse)
                done.append((rows, o, lse))
        # rows masked in every part: weight 0 (not nan), output 0 as in torch
        safe = torch.where(torch.isneginf(total), 0.0, total)
        out = torch.zeros((*q.shape[:-1], kvs[1].shape[-1]), dtype=acc, device=q.device)
        for rows, o, lse in done:
            out[..., rows, :] += torch.exp(lse - safe[..., rows]).unsqueeze(-1) * o.to(acc)
        out = out.to(q.dtype)
        ctx.scale, ctx.plan = scale, plan
        # backward: a row masked everywhere gets lse +inf, so its exp(s - lse) is 0
        ctx.save_for_backward(q, out, torch.where(torch.isneginf(total), float("inf"),
                                                  total), *kvs)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, out, lse, *kvs = ctx.saved_tensors
        grad = grad.contiguous()
        acc = _accumulator(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv: list[torch.Tensor] = []
        for i, parts in enumerate(ctx.plan):
            k, v = kvs[2 * i], kvs[2 * i + 1]
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            for rows, cols, causal, m in parts:
                gq, gk, gv = kernel(grad[..., rows, :], q[..., rows, :], k[..., cols, :],
                                    v[..., cols, :], out[..., rows, :], lse[..., rows], 0.0,
                                    causal, attn_mask=m, scale=ctx.scale)
                dq[..., rows, :] += gq
                dk[..., cols, :] += gk
                dv[..., cols, :] += gv
            dkv += [dk.to(k.dtype), dv.to(v.dtype)]
        return (dq.to(q.dtype), None, None, *dkv)


def _math_blocks(q: torch.Tensor, blocks: Sequence[tuple[torch.Tensor, torch.Tensor,
                                                       list[Part]]],
                 scale: float, groups: int) -> torch.Tensor:
    """The blocks in plain torch ops (autograd's gradient): the online softmax, each
    block's parts as one additive mask (-inf outside them)."""
    acc = _accumulator(q.dtype)
    qf = q.to(acc)
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for kb, vb, parts in blocks:
        mask = _block_mask(parts, q.shape[-2], kb.shape[-2], acc)
        part = _block(qf, kb.to(acc), vb.to(acc), scale, groups, mask)
        state = part if state is None else _merge(state, part)
    assert state is not None
    _, total, acc_out = state
    # a row masked everywhere has total 0 and out 0: it stays 0, as in torch
    return (acc_out / torch.where(total > 0, total, 1)).to(q.dtype)


def _block_mask(parts: list[Part], rows: int, cols: int, dtype: torch.dtype
                ) -> torch.Tensor | None:
    if len(parts) == 1 and parts[0][0] == slice(None) and not parts[0][2]:
        return parts[0][3]
    out = torch.full((rows, cols), float("-inf"), dtype=dtype)
    for r, c, causal, m in parts:
        cut = out[r, c]
        cut.fill_(0.0)
        if causal:
            cut.masked_fill_(torch.ones(cut.shape, dtype=torch.bool).triu(1), float("-inf"))
        if m is not None:
            cut.add_(m.reshape(cut.shape))
    return out


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int,
           mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, l, o)`` of one block: the rows' max score (a constant: the result does not
    depend on it), the sum of ``exp(s - m)`` and its product with v."""
    if groups > 1:
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s + mask.to(s.dtype)
    # a row masked everywhere has max -inf: shifted by the dtype's min, its exp is 0
    m = s.detach().amax(-1, keepdim=True).clamp_min(torch.finfo(s.dtype).min)
    e = torch.exp(s - m)
    return m, e.sum(-1, keepdim=True), e @ v


def _merge(a: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
           b: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online softmax: two blocks' ``(m, l, o)`` rescaled to their common max."""
    m = torch.maximum(a[0], b[0])
    wa, wb = torch.exp(a[0] - m), torch.exp(b[0] - m)
    return m, a[1] * wa + b[1] * wb, a[2] * wa + b[2] * wb


# --- all-to-all (Ulysses) ---------------------------------------------------------------------
def kv_repeats(q_heads: int, kv_heads: int, n: int) -> int:
    """How many times each kv head travels in the all-to-all: the fewest copies (a
    divisor of the group size) that make the kv heads divide by ``n``.

    >>> kv_repeats(8, 2, 4), kv_repeats(8, 4, 4), kv_repeats(8, 1, 2)
    (2, 1, 2)
    """
    groups = q_heads // kv_heads
    return next(c for c in range(1, groups + 1) if groups % c == 0 and (kv_heads * c) % n == 0)


def _all_to_all(setting: Attention, n: int, lengths: tuple[int, int], q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
    """One device's Ulysses attention: its share of the heads over the whole sequence."""
    axis = setting.axis
    copies = kv_repeats(q.shape[-3], k.shape[-3], n) if setting.groups > 1 else 1
    if copies > 1:
        k, v = k.repeat_interleave(copies, -3), v.repeat_interleave(copies, -3)
    qh, kh, vh = (lax.all_to_all(t, axis, -3, -2) for t in (q, k, v))
    to_natural = [_inverse(sequence_order(length, n, setting.balanced)) for length in lengths]
    qh = qh.index_select(-2, to_natural[0])
    kh, vh = kh.index_select(-2, to_natural[1]), vh.index_select(-2, to_natural[1])
    m = None
    if mask:
        m = mask[0]
        if m.ndim >= 3 and m.shape[-3] == q.shape[-3] and q.shape[-3] > 1:
            share = q.shape[-3] // n  # this device's heads after the all-to-all
            m = m.narrow(-3, lax.axis_index(axis) * share, share)
        m = m.index_select(-2, to_natural[0]).index_select(-1, to_natural[1])
    out = F.scaled_dot_product_attention(qh, kh, vh, m, 0.0, setting.causal,
                                         scale=setting.scale,
                                         enable_gqa=setting.groups // copies > 1)
    out = out.index_select(-2, torch.tensor(sequence_order(lengths[0], n, setting.balanced)))
    return lax.all_to_all(out, axis, -2, -3)


def _inverse(order: Sequence[int]) -> torch.Tensor:
    """``inv`` with ``x.index_select(d, inv)`` the natural order of ``x`` in ``order``."""
    inv = torch.empty(len(order), dtype=torch.long)
    inv[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return inv
