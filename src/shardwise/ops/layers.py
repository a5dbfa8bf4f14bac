"""Convolution-net layers on shardwise Tensors: conv and conv_transpose, pools, interpolate,
pad, unfold, pixel/channel shuffles, batch/instance/group/local-response norms,
grid_sample, embedding_bag.

Invariants:
- Every op runs on the ``"free_dims"`` rule (:mod:`shardwise.ops.free_dims`): the batch dim of a
  batched input shards freely, the channels and spatial dims stay whole (the planner
  gathers them first); conv with ``groups == 1`` may also shard its output channels
  with a weight sharded on them (and batch norm its channels), no communication.
- Statistics over the batch (training batch norm, instance norm's running stats)
  keep the batch whole, so each block's statistics are the global ones.
- Running statistics are written as torch writes them: each block updates a copy and
  the result is copied into the caller's tensors (``copy_``), whatever their layout.
- fractional_max_pool draws its random samples over the global shape from torch's
  generator, as single-device torch does, then lays them out like the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.ops.compute import ZeroGrad
from shardwise.ops.free_dims import apply_free_dims, lead
from shardwise.ops.registry import describe, register
from shardwise.sharding.errors import ShardingError
from shardwise.tensors.tensor import Tensor

__all__: list[str] = []


def _batched(x: Any, spatial: int) -> int:
    """1 when ``x`` has a batch dim in front of its channels and ``spatial`` dims."""
    return 1 if x.ndim == spatial + 2 else 0


def _whole(t: Any) -> tuple[int, ...] | None:
    return None if t is None else (-1,) * t.ndim


# --- convolutions -------------------------------------------------------------------------
def _conv(fn: Any, spatial: int, transposed: bool) -> Callable[..., Any]:
    def handler(x: Any, weight: Any, bias: Any = None, *args: Any, **kwargs: Any) -> Any:
        b = _batched(x, spatial)
        # (stride, padding, dilation, groups) or (stride, padding, output_padding, groups)
        groups = kwargs.get("groups", args[3] if len(args) > 3 else 1)
        n = weight.ndim
        wdim = 1 if transposed else 0  # the weight's output-channel dim
        out_ch = 1 if groups == 1 else -1  # factor 1: output channels, with the weight's
        w = tuple(out_ch if d == wdim else -1 for d in range(n))
        bf = None if bias is None else (out_ch,)
        out = lead(x.ndim, b)
        out = (*out[:b], out_ch, *out[b + 1:])

        def call(xs: torch.Tensor, ws: torch.Tensor, bs: Any) -> torch.Tensor:
            if ws.shape[wdim] == 0:  # a size-0 block of output channels: torch refuses it
                one = ws.new_zeros((*ws.shape[:wdim], 1, *ws.shape[wdim + 1:]))
                return fn(xs, one, None, *args, **kwargs).narrow(b, 0, 0)
            return fn(xs, ws, bs, *args, **kwargs)

        return apply_free_dims(fn.__name__, call, [x, weight, bias], [lead(x.ndim, b), w, bf],
                               [out])

    return handler


for _n in (1, 2, 3):
    _f = getattr(F, f"conv{_n}d")
    register(_f, getattr(torch, f"conv{_n}d"))(_conv(_f, _n, False))
    _t = getattr(F, f"conv_transpose{_n}d")
    register(_t, getattr(torch, f"conv_transpose{_n}d"))(_conv(_t, _n, True))


# --- batch-wise ops: the batch dim (when there is one) shards freely, the rest whole ------
def _per_batch(fn: Any, spatial: int | None, name: str, tail: int = 0) -> Callable[..., Any]:
    """``fn(x, *args)`` whose leading batch dim shards freely: ``x`` is batched when it
    has ``spatial + 2`` dims (``None``: always, its first dim); ``tail``: every dim but
    the last ``tail`` is a batch dim (pixel_shuffle's ``(*, C, H, W)``). A tuple result
    (values, indices) is laid out like the batch too."""
    label = name

    def handler(x: Any, *args: Any, **kwargs: Any) -> Any:
        if tail:
            b = max(x.ndim - tail, 0)
        else:
            b = (1 if x.ndim else 0) if spatial is None else _batched(x, spatial)
        ins = lead(x.ndim, b)

        def call(xs: torch.Tensor) -> Any:
            if xs.numel() == 0 and x.numel():
                return _empty_result(fn, xs, args, kwargs)
            return fn(xs, *args, **kwargs)

        return apply_free_dims(label, call, [x], [ins], None if not b else _lead_outs(call, x, b))

    return handler


def _empty_result(fn: Any, xs: torch.Tensor, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
    """``fn`` on an empty block of a non-empty value: torch's CPU kernels of some ops
    mis-shape an empty input's result or gradient (pixel_unshuffle returns its input's
    shape; pixel_shuffle's backward raises), so the (empty) results take their shapes
    from the meta kernel (or, where it has none, a call without autograd) and are
    linked to ``xs`` with zero gradients."""
    try:
        r = fn(torch.empty(xs.shape, dtype=xs.dtype, device="meta"), *args, **kwargs)
    except (RuntimeError, TypeError, NotImplementedError):
        with torch.no_grad():
            r = fn(xs.detach(), *args, **kwargs)
    def made(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        out = torch.zeros(v.shape, dtype=v.dtype, device=xs.device)
        return ZeroGrad.apply(out, False, xs) if out.is_floating_point() or (
            out.is_complex()) else out

    return tuple(made(v) for v in r) if isinstance(r, tuple) else made(r)


def _lead_outs(call: Callable[..., Any], x: Any, b: int) -> list[tuple[int, ...]]:
    r = call(torch.empty(tuple(x.shape), dtype=x.dtype, device="meta"))
    rs = [r] if isinstance(r, torch.Tensor) else [v for v in r if isinstance(v, torch.Tensor)]
    return [lead(v.ndim, b) for v in rs]


_POOLS: dict[str, int] = {}
for _n in (1, 2, 3):
    _POOLS.update({f"avg_pool{_n}d": _n, f"max_pool{_n}d": _n, f"_max_pool{_n}d": _n,
                   f"max_pool{_n}d_with_indices": _n, f"adaptive_avg_pool{_n}d": _n,
                   f"adaptive_max_pool{_n}d": _n, f"_adaptive_max_pool{_n}d": _n,
                   f"adaptive_max_pool{_n}d_with_indices": _n, f"lp_pool{_n}d": _n})
for _name, _n in _POOLS.items():
    _fn = getattr(F, _name, None)
    if _fn is not None:
        register(_fn, getattr(torch, _name, None))(_per_batch(_fn, _n, _name.strip("_")))

# interpolate covers upsample, upsample_nearest, upsample_bilinear (they call it)
register(F.interpolate)(_per_batch(F.interpolate, None, "interpolate"))
register(torch._C._nn._upsample_bilinear2d_aa, torch.ops.aten._upsample_bilinear2d_aa)(
    _per_batch(torch._C._nn._upsample_bilinear2d_aa, None, "_upsample_bilinear2d_aa"))
register(F.unfold)(_per_batch(F.unfold, 2, "unfold"))
register(F.pixel_shuffle, torch.pixel_shuffle)(
    _per_batch(F.pixel_shuffle, None, "pixel_shuffle", tail=3))
register(F.pixel_unshuffle, torch.pixel_unshuffle)(
    _per_batch(F.pixel_unshuffle, None, "pixel_unshuffle", tail=3))
register(F.channel_shuffle, torch.channel_shuffle, getattr(torch, "native_channel_shuffle",
                                                            None))(
    _per_batch(F.channel_shuffle, None, "channel_shuffle"))
register(F.local_response_norm)(_per_batch(F.local_response_norm, None, "local_response_norm"))


# torch._C._nn.pad: what F.pad calls, and what Dynamo records once it has traced F.pad
@register(F.pad, torch._C._nn.pad, torch.constant_pad_nd)
def pad(x: Any, pad: Any, mode: str = "constant", value: Any = None) -> Any:
    """A dim with no padding shards freely in constant mode; other modes keep the batch
    dim (a dim that is not padded) only, as their kernels refuse empty channels."""
    amounts = [int(p) for p in pad]
    if isinstance(mode, (int, float)) and value is None:  # constant_pad_nd(x, pad, value)
        mode, value = "constant", mode
    k = len(amounts) // 2
    padded = {x.ndim - 1 - i for i in range(k) if amounts[2 * i] or amounts[2 * i + 1]}
    if mode == "constant":
        free = tuple(d if d not in padded else -1 for d in range(x.ndim))
    else:
        free = lead(x.ndim, 1 if x.ndim == k + 2 else 0)
    out = tuple(f if f >= 0 else -1 for f in free)
    return apply_free_dims("pad", lambda xs: F.pad(xs, amounts, mode, value), [x], [free], [out])


# --- fractional max pool: random samples drawn over the global shape ------------------------
def _fractional(inner: Any, spatial: int) -> Callable[..., Any]:
    def handler(x: Any, kernel_size: Any, output_size: Any = None, output_ratio: Any = None,
                return_indices: bool = False, _random_samples: Any = None) -> Any:
        b = _batched(x, spatial)
        if _random_samples is None:  # torch's draw, over the global shape
            n = x.shape[0] if b else 1
            _random_samples = torch.rand(n, x.shape[-spatial - 1], spatial, dtype=x.dtype,
                                         device=x.device)
        if output_size is None and output_ratio is not None:  # torch's own arithmetic
            ratio = [output_ratio] * spatial if isinstance(output_ratio, (int, float)) else list(
                output_ratio)
            output_size = [int(x.shape[-spatial + i] * ratio[i]) for i in range(spatial)]
            output_ratio = None
        samples_free = lead(3, b)

        def call(xs: torch.Tensor, rs: torch.Tensor) -> Any:
            return inner(xs, kernel_size, output_size, output_ratio, True, _random_samples=rs)

        out = lead(x.ndim, b)
        vals, idx = apply_free_dims(f"fractional_max_pool{spatial}d", call, [x, _random_samples],
                                    [lead(x.ndim, b), samples_free], [out, out])
        return (vals, idx) if return_indices else vals

    return handler


for _n in (2, 3):
    _inner = getattr(F, f"fractional_max_pool{_n}d_with_indices")
    register(getattr(F, f"fractional_max_pool{_n}d"), _inner,
             getattr(F, f"_fractional_max_pool{_n}d"))(_fractional(_inner, _n))


def _unpool(fn: Any, spatial: int) -> Callable[..., Any]:
    def handler(x: Any, indices: Any, *args: Any, **kwargs: Any) -> Any:
        b = _batched(x, spatial)
        ins = lead(x.ndim, b)
        if b and "output_size" in kwargs and kwargs["output_size"] is not None:
            size = list(kwargs["output_size"])
            if len(size) == spatial + 2:  # a full size names the batch: the block's
                kwargs = dict(kwargs, output_size=size[-spatial:])
        return apply_free_dims(fn.__name__, lambda xs, ix: fn(xs, ix, *args, **kwargs),
                               [x, indices], [ins, ins], [lead(x.ndim, b)])

    return handler


for _n in (1, 2, 3):
    _fn = getattr(F, f"max_unpool{_n}d")
    register(_fn)(_unpool(_fn, _n))


# --- norms ------------------------------------------------------------------------------------
@register(F.group_norm)
def group_norm(x: Any, num_groups: int, weight: Any = None, bias: Any = None,
               eps: float = 1e-5) -> Any:
    return apply_free_dims("group_norm", lambda xs, w, b: F.group_norm(xs, num_groups, w, b, eps),
                           [x, weight, bias], [lead(x.ndim, 1), _whole(weight), _whole(bias)],
                           [lead(x.ndim, 1)])


@register(torch.native_group_norm)
def native_group_norm(x: Any, weight: Any, bias: Any, n: int, c: int, hw: int, group: int,
                      eps: float) -> Any:
    return apply_free_dims(
        "native_group_norm",
        lambda xs, w, b: torch.native_group_norm(xs, w, b, xs.shape[0], c, hw, group, eps),
        [x, weight, bias], [lead(x.ndim, 1), _whole(weight), _whole(bias)],
        [lead(x.ndim, 1), lead(2, 1), lead(2, 1)])


@register(torch.native_layer_norm)
def native_layer_norm(x: Any, normalized_shape: Any, weight: Any, bias: Any,
                      eps: float) -> Any:
    k = x.ndim - len(normalized_shape)
    shape = list(normalized_shape)
    return apply_free_dims(
        "native_layer_norm", lambda xs, w, b: torch.native_layer_norm(xs, shape, w, b, eps),
        [x, weight, bias], [lead(x.ndim, k), _whole(weight), _whole(bias)],
        [lead(x.ndim, k)] * 3)


def _channels(x: Any, batch_free: bool) -> tuple[int, ...]:
    """(N, C, *spatial): the batch as factor 0 when ``batch_free``, C as factor 1."""
    return tuple((0 if batch_free else -1) if d == 0 else (1 if d == 1 else -1)
                 for d in range(x.ndim))


def _write_stats(stats: tuple[Any, ...], updated: tuple[Any, ...]) -> None:
    """Copy each block-updated running statistic into the caller's tensor."""
    for s, u in zip(stats, updated):
        if isinstance(s, Tensor):
            s.copy_(u)
        elif s is not None:
            with torch.no_grad():
                s.copy_(u.to_torch())


def _norm_with_stats(name: str, x: Any, stats: tuple[Any, Any], params: tuple[Any, Any],
                     batch_stats: bool, run: Callable[..., Any], extra_outs: int = 0) -> Any:
    """``run(x, rm, rv, w, b)`` on blocks of (N, C, ...) ``x``: the channels shard
    freely; the batch too unless ``batch_stats`` (statistics over the batch). Running
    stats that ``run`` updates get a copy per block, copied back into the caller's."""
    c = (1,)
    update = batch_stats and any(s is not None for s in stats)
    ops = [x, *stats, *params]
    free = [_channels(x, not batch_stats)] + [None if t is None else c for t in ops[1:]]
    outs = [_channels(x, not batch_stats)] + [c] * extra_outs

    def call(xs: torch.Tensor, rm: Any, rv: Any, w: Any, b: Any) -> Any:
        rm = rm.clone() if update and rm is not None else rm
        rv = rv.clone() if update and rv is not None else rv
        r = _empty_block(name, run, xs, rm, rv, w, b) if xs.numel() == 0 else run(
            xs, rm, rv, w, b)
        rs = list(r) if isinstance(r, tuple) else [r]
        if update:
            rs += [t for t in (rm, rv) if t is not None]
        return tuple(rs) if len(rs) > 1 else rs[0]

    n_upd = sum(s is not None for s in stats) if update else 0
    r = apply_free_dims(name, call, ops, free, outs + [c] * n_upd)
    if not update:
        return r
    rs = list(r)
    _write_stats(tuple(s for s in stats if s is not None), tuple(rs[len(rs) - n_upd:]))
    rs = rs[:len(rs) - n_upd]
    return tuple(rs) if len(rs) > 1 else rs[0]


def _empty_block(name: str, run: Callable[..., Any], xs: torch.Tensor, rm: Any, rv: Any,
                 w: Any, b: Any) -> Any:
    """``run`` on a block with no elements (a device with no channels): torch's CPU
    backward of the native norms divides by the block's size (SIGFPE, a crash) and its
    training forward refuses it, so the block's output is its (empty) input linked to
    the weights with zero gradients, and the native ops' statistics are empty too."""
    out = ZeroGrad.apply(torch.empty_like(xs), False, xs, w, b)
    if "native" in name:  # (output, mean, invstd): one statistic per channel, none here
        return out, xs.new_empty(0), xs.new_empty(0)
    return out


@register(F.batch_norm)
def batch_norm(x: Any, running_mean: Any, running_var: Any, weight: Any = None,
               bias: Any = None, training: bool = False, momentum: float = 0.1,
               eps: float = 1e-5, *args: Any) -> Any:
    if x.ndim < 2:  # no channel dim: torch's own rules (it takes an empty 1-D input), whole
        ops = [x, running_mean, running_var, weight, bias]
        return apply_free_dims("batch_norm", lambda xs, rm, rv, w, b: F.batch_norm(
            xs, rm, rv, w, b, training, momentum, eps), ops, [_whole(t) for t in ops])
    return _norm_with_stats(
        "batch_norm", x, (running_mean, running_var), (weight, bias), training,
        lambda xs, rm, rv, w, b: F.batch_norm(xs, rm, rv, w, b, training, momentum, eps))


@register(F.instance_norm)
def instance_norm(x: Any, running_mean: Any = None, running_var: Any = None,
                  weight: Any = None, bias: Any = None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5, *args: Any) -> Any:
    # running stats average over the batch: only then does the batch stay whole
    stats_over_batch = use_input_stats and running_mean is not None
    return _norm_with_stats(
        "instance_norm", x, (running_mean, running_var), (weight, bias), stats_over_batch,
        lambda xs, rm, rv, w, b: F.instance_norm(xs, rm, rv, w, b, use_input_stats,
                                                 momentum, eps))


def _native_bn(fn: Any, name: str) -> Callable[..., Any]:
    def handler(x: Any, weight: Any, bias: Any, *rest: Any) -> Any:
        no_stats = len(rest) == 3  # the overload without them: (training, momentum, eps)
        if no_stats:
            rest = (None, None, *rest)
        running_mean, running_var, training, momentum, eps = rest
        # eval mode returns empty statistics: laid out whole
        return _norm_with_stats(
            name, x, (running_mean, running_var), (weight, bias), training,
            lambda xs, rm, rv, w, b: fn(xs, w, b, training, momentum, eps) if no_stats
            else fn(xs, w, b, rm, rv, training, momentum, eps),
            extra_outs=2 if training else 0)

    return handler


register(torch.native_batch_norm)(_native_bn(torch.native_batch_norm, "native_batch_norm"))
register(torch._native_batch_norm_legit)(
    _native_bn(torch._native_batch_norm_legit, "_native_batch_norm_legit"))


# --- grid_sample and embedding_bag ----------------------------------------------------------
def _grid(fn: Any, name: str) -> Callable[..., Any]:
    def handler(x: Any, grid: Any, *args: Any, **kwargs: Any) -> Any:
        return apply_free_dims(name, lambda xs, gs: fn(xs, gs, *args, **kwargs), [x, grid],
                               [lead(x.ndim, 1), lead(grid.ndim, 1)], [lead(x.ndim, 1)])

    return handler


register(F.grid_sample)(_grid(F.grid_sample, "grid_sample"))
register(torch.grid_sampler_2d)(_grid(torch.grid_sampler_2d, "grid_sampler_2d"))
register(torch.grid_sampler_3d)(_grid(torch.grid_sampler_3d, "grid_sampler_3d"))
register(torch.grid_sampler)(_grid(torch.grid_sampler, "grid_sampler"))


@register(F.embedding_bag)
def embedding_bag(ids: Any, weight: Any, offsets: Any = None, max_norm: Any = None,
                  norm_type: float = 2, scale_grad_by_freq: bool = False, mode: str = "mean",
                  sparse: bool = False, per_sample_weights: Any = None,
                  include_last_offset: bool = False, padding_idx: Any = None) -> Any:
    """2-D bags shard by bag; the embedding dim shards freely (each column alone)."""
    if max_norm is not None:
        raise ShardingError(
            f"Cannot run F.embedding_bag(max_norm={max_norm}) on a shardwise.Tensor table "
            f"({describe([weight])}): it renormalizes the looked-up rows of the table in "
            "place, a write with no sharding rule. Got max_norm; renormalize those rows "
            "yourself under torch.no_grad() (table[ids] = ...) and call without it.")
    b = 1 if ids.ndim == 2 else 0
    bags = lead(ids.ndim, b)

    def call(i: torch.Tensor, w: torch.Tensor, o: Any, p: Any) -> torch.Tensor:
        return F.embedding_bag(i, w, o, None, norm_type, scale_grad_by_freq, mode, sparse,
                               p, include_last_offset, padding_idx)

    return apply_free_dims("embedding_bag", call, [ids, weight, offsets, per_sample_weights],
                           [bags, (-1, 1), _whole(offsets), None if per_sample_weights is None
                            else bags], [(0 if b else -1, 1)])
