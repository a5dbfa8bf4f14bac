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
from shardwise.sharding.shapes import split_bounds
from shardwise.spmd import lax
from shardwise.spmd.shard_map import shard_map

__all__ = ["Attention", "attend", "sequence_order"]


@functools.lru_cache(maxsize=256)
def sequence_order(length: int, size: int, balanced: bool) -> tuple[int, ...]:
    """The natural position at each index of the CP order of a sequence of ``length``
    over ``size`` devices. Head-tail (``balanced``): device ``r``'s block (its split
    rule share) holds a head piece from the front and a tail piece from the back, the
    tails in reverse device order, so causal work is even; else the natural order.

    >>> sequence_order(8, 2, True)      # device 0: chunks 0 and 3, device 1: 1 and 2
    (0, 1, 6, 7, 2, 3, 4, 5)
    >>> sequence_order(7, 2, True)      # uneven: blocks of 4 and 3
    (0, 1, 5, 6, 2, 3, 4)
    """
    if not balanced or size == 1:
        return tuple(range(length))
    blocks = [split_bounds(length, size, r) for r in range(size)]
    heads = [(stop - start + 1) // 2 for start, stop in blocks]
    tails = [stop - start - h for (start, stop), h in zip(blocks, heads)]
    front, out = sum(heads), list[int]()
    for r in range(size):
        head = sum(heads[:r])
        tail = front + sum(tails[r + 1:])
        out += range(head, head + heads[r])
        out += range(tail, tail + tails[r])
    return tuple(out)


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


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype == torch.float64 else torch.float32


# --- ring -----------------------------------------------------------------------------------
def _ring(setting: Attention, n: int, lengths: tuple[int, int], q: torch.Tensor,
          k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
    """One device's ring attention: its queries against every KV block in turn."""
    r = lax.axis_index(setting.axis)
    acc = _accumulator(q.dtype)
    qf = q.to(acc)
    qpos = _positions(lengths[0], n, setting.balanced, r)
    scale = 1 / math.sqrt(q.shape[-1]) if setting.scale is None else setting.scale
    split = k.shape[-1]
    kv = torch.cat([k, v], -1)  # one exchange per hop carries both
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    ring = [(j, (j + 1) % n) for j in range(n)]
    for hop in range(n):
        if hop:
            kv = lax.ppermute(kv, setting.axis, ring)
        src = (r - hop) % n
        start, stop = split_bounds(lengths[1], n, src)
        allowed = _causal(qpos, _positions(lengths[1], n, setting.balanced, src),
                          setting.causal)
        block_mask = mask[0][..., start:stop] if mask else None
        if allowed is False or stop == start or q.shape[-2] == 0 or (
                setting.mask == "bool" and block_mask is not None and not bool(
                    block_mask.any())):
            continue  # every pair of this block is masked: nothing to add
        kb, vb = kv.to(acc).split([split, kv.shape[-1] - split], -1)
        part = _block(qf, kb, vb, scale, setting.groups, allowed, block_mask)
        state = part if state is None else _merge(state, part)
    if state is None:
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    else:
        _, total, acc_out = state
        # a row masked everywhere has total 0 and out 0: it stays 0, as in torch
        out = (acc_out / torch.where(total > 0, total, 1)).to(q.dtype)
    if n > 1 and kv.requires_grad and torch.is_grad_enabled():
        # the last block may have been skipped here and used elsewhere: keep it in the
        # graph (zero gradient) so every device runs the same reverse rotations
        out = _Keep.apply(out, kv)
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


def _causal(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool) -> torch.Tensor | bool:
    """Which (query, key) pairs of a block may attend: True (all), False (none) or a
    boolean matrix, from the natural positions (top-left aligned, as torch)."""
    if not causal or len(kpos) == 0 or len(qpos) == 0:
        return True
    if int(kpos.max()) <= int(qpos.min()):
        return True
    if int(kpos.min()) > int(qpos.max()):
        return False
    return kpos[None, :] <= qpos[:, None]


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int,
           allowed: torch.Tensor | bool, mask: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, l, o)`` of one block: the rows' max score (a constant: the result does not
    depend on it), the sum of ``exp(s - m)`` and its product with v."""
    if groups > 1:
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    s = (q @ k.transpose(-2, -1)) * scale
    if isinstance(allowed, torch.Tensor):
        s = s.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        s = (s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
             else s + mask.to(s.dtype))
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
