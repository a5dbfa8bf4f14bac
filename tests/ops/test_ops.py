"""torch functions on shardwise Tensors give torch's values on the global tensor.

Each case runs one torch call on plain tensors and on shardwise Tensors laid out
on a simulated 2x2 mesh in several layouts, and compares the gathered value (and,
where the op is differentiable, the input gradients) with torch's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Partial, PlacementMapping, Replicated, Sharded
from shardwise.ops import fallbacks
from tests.helpers.meshes import M22 as MESH

R, S0, S1, S2 = Replicated(), Sharded(0), Sharded(1), Sharded(2)
LAYOUTS = [(R, R), (S0, R), (R, S1), (S0, S1), (S1, S0)]


def put(x: torch.Tensor, placements: Any, grad: bool = False) -> sw.Tensor:
    places = [p if not isinstance(p, Sharded) or p.axis < x.ndim else Replicated()
              for p in placements]
    return sw.tensor(x, sharding=PlacementMapping(MESH, places), requires_grad=grad)


def check(fn: Callable[..., Any], *inputs: torch.Tensor, grad: bool = True,
          exact: bool = False, layouts: list[Any] = LAYOUTS) -> None:
    grad = grad and all(x.is_floating_point() for x in inputs)
    ref_in = [x.clone().requires_grad_(grad) for x in inputs]
    ref = fn(*ref_in)
    for lay in layouts:
        ins = [put(x, lay, grad) for x in inputs]
        with warnings.catch_warnings():
            warnings.simplefilter("error", sw.ShardwiseFallbackWarning)
            out = fn(*ins)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        refs = ref if isinstance(ref, (tuple, list)) else (ref,)
        for o, r in zip(outs, refs):
            assert isinstance(o, sw.Tensor), (lay, type(o))
            assert o.shape == r.shape and o.dtype == r.dtype, (lay, o, r.shape)
            got = o.to_torch()
            if exact:
                assert torch.equal(got, r), (lay, got, r)
            else:
                torch.testing.assert_close(got, r, rtol=1e-5, atol=1e-6, msg=str(lay))
        if grad and refs[0].is_floating_point():
            g = torch.randn(refs[0].shape, generator=torch.Generator().manual_seed(3))
            want = torch.autograd.grad(refs[0], ref_in, g, retain_graph=True)
            outs[0].backward(put(g, (R, R)))
            for x, w in zip(ins, want):
                assert x.grad is not None
                torch.testing.assert_close(x.grad.to_torch(), w, rtol=1e-5, atol=1e-6,
                                           msg=f"grad {lay}")


def rnd(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


X = rnd(4, 6)
Y = rnd(4, 6, seed=1)
W = rnd(8, 6, seed=2)
B = rnd(8, seed=3)

UNARY = {
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
    "relu": F.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "exp": torch.exp,
    "neg": lambda x: -x, "abs": torch.abs, "rsqrt": lambda x: (x.abs() + 1).rsqrt(),
    "clamp": lambda x: x.clamp(-0.5, 0.5), "pow": lambda x: x ** 2, "rpow": lambda x: 2 ** x,
    "square": torch.square, "erf": torch.erf, "log1p": lambda x: torch.log1p(x.abs()),
    "mul_const": lambda x: x * 3.0, "rsub": lambda x: 1 - x, "radd": lambda x: 2 + x,
    "rdiv": lambda x: 1 / (x.abs() + 1), "float": lambda x: x.float(),
    "to_double": lambda x: x.to(torch.float64), "double": lambda x: x.double(),
    "clone": torch.clone, "contiguous": lambda x: x.contiguous(),
    "leaky_relu": F.leaky_relu, "softplus": F.softplus, "masked_fill":
        lambda x: x.masked_fill(x > 0, -1e9), "where": lambda x: torch.where(x > 0, x, 0.0),
    "tril": torch.tril, "triu": lambda x: x.triu(1),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name: str) -> None:
    check(UNARY[name], X)


BINARY = {
    "add": torch.add, "add_alpha": lambda a, b: torch.add(a, b, alpha=2.0), "sub": torch.sub,
    "mul": torch.mul, "div": lambda a, b: a / (b.abs() + 1), "maximum": torch.maximum,
    "minimum": torch.minimum, "lerp": lambda a, b: torch.lerp(a, b, 0.3),
    "addcmul": lambda a, b: torch.addcmul(a, a, b, value=0.5),
    "addcdiv": lambda a, b: torch.addcdiv(a, a, b.abs() + 1, value=0.5),
    "floor_div": lambda a, b: torch.div(a, b.abs() + 1, rounding_mode="floor"),
    "eq": lambda a, b: (a > b).float(), "atan2": torch.atan2,
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary(name: str) -> None:
    check(BINARY[name], X, Y, grad=name not in ("floor_div", "eq"))


SHAPES = {
    "view": lambda x: x.view(2, 2, 6), "reshape": lambda x: x.reshape(-1),
    "transpose": lambda x: x.transpose(0, 1), "t": lambda x: x.t(), "T": lambda x: x.T,
    "mT": lambda x: x.mT, "permute": lambda x: x.permute(1, 0),
    "unsqueeze": lambda x: x.unsqueeze(1), "squeeze": lambda x: x.unsqueeze(0).squeeze(0),
    "flatten": lambda x: x.view(2, 2, 6).flatten(1), "unflatten": lambda x: x.unflatten(1, (2, 3)),
    "cat": lambda x: torch.cat([x, x * 2], 1), "stack": lambda x: torch.stack([x, x + 1], 0),
    "chunk": lambda x: torch.chunk(x, 3, 1), "split": lambda x: x.split([2, 4], 1),
    "narrow": lambda x: x.narrow(1, 1, 3), "select": lambda x: x.select(0, 2),
    "getitem": lambda x: x[1:3, ::2], "getitem_none": lambda x: x[None, :, 2],
    "unbind": lambda x: x.unbind(0), "expand": lambda x: x[:1].expand(3, 6),
    "index_select": lambda x: torch.index_select(x, 1, torch.tensor([0, 5, 2])),
    "advanced_index": lambda x: x.index_select(0, torch.tensor([3, 1])),
    "index_tensor": lambda x: x[torch.tensor([3, -4, 1, 3])],
    "index_list_dim1": lambda x: x[:, [5, 0, -1]],
    "complex_views": lambda x: torch.view_as_real(
        torch.view_as_complex(x.reshape(4, 3, 2)) * (1 + 2j)).flatten(1),
    "repeat_interleave": lambda x: torch.repeat_interleave(x, 2, dim=1),
    "repeat_interleave_rows": lambda x: x.repeat_interleave(3, 0),
    "flip": lambda x: x.flip(0), "flip_both": lambda x: torch.flip(x, [0, 1]),
    "flip_kw": lambda x: torch.flip(x, dims=(1,)), "roll": lambda x: torch.roll(x, 2, 1),
    "roll_two": lambda x: x.roll((1, -2), (0, 1)), "roll_flat": lambda x: torch.roll(x, 3),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shapes(name: str) -> None:
    check(SHAPES[name], X, exact=True)


REDUCTIONS = {
    "sum": lambda x: x.sum(), "sum_dim": lambda x: x.sum(1), "mean": lambda x: x.mean(0),
    "mean_keep": lambda x: x.mean(-1, keepdim=True), "amax": lambda x: x.amax(1),
    "max_all": lambda x: x.max(), "max_dim": lambda x: x.max(1),
    "min_dim": lambda x: torch.min(x, 0), "var": lambda x: x.var(1),
    "var_unbiased": lambda x: x.var(0, unbiased=False), "std": lambda x: x.std(),
    "prod": lambda x: x.prod(1), "argmax": lambda x: x.argmax(1),
    "argmax_all": lambda x: x.argmax(), "any": lambda x: (x > 1).any(1),
    "all": lambda x: (x > -3).all(), "topk": lambda x: x.topk(2, 1),
    "cumsum": lambda x: x.cumsum(1), "logsumexp": lambda x: x.logsumexp(1),
    "softmax": lambda x: F.softmax(x, -1), "log_softmax": lambda x: F.log_softmax(x, 0),
    "tensor_softmax": lambda x: x.softmax(1), "norm": lambda x: torch.linalg.vector_norm(x),
    "norm_inf": lambda x: torch.linalg.vector_norm(x, float("inf")),
    "norm_dim": lambda x: x.norm(dim=1),
    "sort": lambda x: x.sort(1), "sort_desc": lambda x: torch.sort(x, 0, descending=True),
    "argsort": lambda x: x.argsort(dim=1, stable=True),
    # values and indices as torch's named tuple (median(dim) raised AttributeError)
    "median_all": lambda x: x.median(), "median_dim": lambda x: x.median(1),
    "median_keep": lambda x: torch.median(x, 0, keepdim=True),
    "nanmedian_dim": lambda x: x.nanmedian(dim=-1),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reductions(name: str) -> None:
    check(REDUCTIONS[name], X,
          grad=name not in ("argmax", "argmax_all", "any", "all", "argsort"))


def test_linear_matmul_einsum_bmm() -> None:
    check(lambda x, w, b: F.linear(x, w, b), X, W, B)
    check(lambda x, w: F.linear(x, w), X, W)
    check(lambda x, w: x @ w.t(), X, W)
    check(lambda x, w: torch.matmul(x, w.T), X, W)
    check(lambda x, w: torch.einsum("ij,kj->ik", x, w), X, W)
    a, b = rnd(2, 3, 4), rnd(2, 4, 5, seed=1)
    check(torch.bmm, a, b, layouts=[(R, R), (S0, R), (S0, S2), (R, S1)])


def test_layer_norm_rms_norm() -> None:
    w, b = rnd(6, seed=4), rnd(6, seed=5)
    check(lambda x, w, b: F.layer_norm(x, (6,), w, b), X, w, b)
    check(lambda x: F.layer_norm(x, (6,)), X)
    check(lambda x, w: F.rms_norm(x, (6,), w, 1e-6), X, w)


def test_embedding_on_either_dim() -> None:
    table = rnd(10, 6)
    ids = torch.tensor([[1, 3, 9], [0, 3, 2]])
    ref = F.embedding(ids, table)
    for lay in [(R, R), (S0, R), (R, S1), (S0, S1)]:
        t = put(table, lay)
        out = F.embedding(ids, t)
        assert torch.equal(out.to_torch(), ref)
        out2 = F.embedding(put(ids, (S0, R)), t)
        assert torch.equal(out2.to_torch(), ref)


def test_cross_entropy_batch_or_class_sharded() -> None:
    logits, target = rnd(8, 5), torch.tensor([0, 4, 2, 1, 3, 3, -100, 2])
    for reduction in ("mean", "sum", "none"):
        ref_in = logits.clone().requires_grad_()
        ref = F.cross_entropy(ref_in, target, reduction=reduction)
        ref.sum().backward()
        for lay in [(R, R), (S0, R), (R, S1), (S0, S1)]:
            lg = put(logits, lay, grad=True)
            out = F.cross_entropy(lg, put(target, (lay[0], R)), reduction=reduction)
            torch.testing.assert_close(out.to_torch(), ref, rtol=1e-5, atol=1e-6)
            out.sum().backward()
            assert lg.grad is not None
            torch.testing.assert_close(lg.grad.to_torch(), ref_in.grad, rtol=1e-5, atol=1e-6)


def test_scaled_dot_product_attention_heads_sharded() -> None:
    q, k, v = rnd(2, 4, 5, 3), rnd(2, 4, 5, 3, seed=1), rnd(2, 4, 5, 3, seed=2)
    lays = [(R, R), (S0, S1), (R, S1), (S1, R), (R, S2)]  # S2: the query positions
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v,
          layouts=lays)
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), q, k, v,
          layouts=lays)


def test_dropout_matches_single_device_torch_for_a_seed() -> None:
    x = rnd(6, 8)
    torch.manual_seed(7)
    ref = F.dropout(x, 0.25)
    for lay in [(R, R), (S0, S1), (S1, R)]:
        torch.manual_seed(7)
        out = F.dropout(put(x, lay), 0.25)
        assert torch.equal(out.to_torch(), ref), lay
        torch.manual_seed(7)
        assert torch.equal(torch.nn.Dropout(0.25)(put(x, lay)).to_torch(), ref)
    assert F.dropout(put(x, (S0, R)), 0.25, training=False).to_torch().equal(x)


def test_partial_operands_are_resolved_before_nonlinear_ops() -> None:
    x = put(X, (R, S1))
    w = put(W.t().contiguous(), (S0, R))  # contraction over tp leaves a Partial
    h = x @ w
    assert h.dist_layout.is_partial
    torch.testing.assert_close(F.gelu(h).to_torch(), F.gelu(X @ W.t()))
    torch.testing.assert_close((h * 2 + 1).to_torch(), (X @ W.t()) * 2 + 1)


def test_op_without_rule_runs_gathered_with_one_warning() -> None:
    # nonzero: an output size that depends on every value (no rule can shard it)
    x = put(X, (S0, S1))
    fallbacks.forget_warnings()  # once per op and process: whatever ran before
    with pytest.warns(sw.ShardwiseFallbackWarning, match="nonzero"):
        out = torch.nonzero(x)
    assert isinstance(out, sw.Tensor) and torch.equal(out.to_torch(), torch.nonzero(X))
    assert not out.dist_layout.is_partial and not out.dist_layout.sharded_axes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.nonzero(x, as_tuple=False)  # once per op: no second warning


def test_inplace_op_without_rule_raises_naming_it() -> None:
    x = put(X, (S0, S1))
    before = x.to_torch().clone()
    with pytest.raises(sw.ShardingError, match="index_fill_"):
        x.index_fill_(0, torch.tensor([1]), 0.0)
    assert torch.equal(x.to_torch(), before)


def test_inplace_ops_write_each_buffer_once() -> None:
    for lay in LAYOUTS:
        x = put(X, lay)
        x.add_(1.0).mul_(2.0)
        x.addcmul_(put(Y, lay), put(Y, lay), value=0.5)
        x.lerp_(put(Y, (R, R)), 0.5)  # other layout: computed, then copied in
        want = ((X + 1) * 2 + 0.5 * Y * Y).lerp(Y, 0.5)
        torch.testing.assert_close(x.to_torch(), want)
        x.zero_()
        assert torch.equal(x.to_torch(), torch.zeros_like(X))
        x += 3
        assert torch.equal(x.to_torch(), torch.full_like(X, 3.0))
        x.copy_(put(Y, (R, R)))
        assert torch.equal(x.to_torch(), Y)


def test_partial_tensor_refuses_inplace_writes() -> None:
    p = put(X, (R, Partial()))
    for other in (put(Y, (R, R)), put(Y, (R, Partial()))):
        with pytest.raises(sw.ShardingError, match="Partial"):
            p.add_(other)
    torch.testing.assert_close(p.to_torch(), X)
    with pytest.raises(sw.ShardingError, match="Partial"):
        p.fill_(1.0)
    p.zero_()  # zeros are a Partial value too
    assert torch.equal(p.to_torch(), torch.zeros_like(X))


def test_a_failing_local_op_names_the_op_and_its_rule() -> None:
    for lay in [(R, R), (S0, S1)]:
        with pytest.raises(sw.ShardingError, match=r"bitwise_not failed on the local blocks"):
            torch.bitwise_not(put(X, lay))


def test_metadata_and_conversions_are_torchs() -> None:
    x = put(X, (S0, S1))
    assert isinstance(x, torch.Tensor) and torch.is_tensor(x)
    assert x.shape == torch.Size([4, 6]) and x.size(1) == 6 and x.dim() == 2 and x.ndim == 2
    assert x.layout == torch.strided and x.device == torch.device("cpu")
    assert x.is_floating_point() and not x.is_complex() and x.numel() == 24
    assert x.element_size() == 4 and len(x) == 4
    assert x.bfloat16().dtype == torch.bfloat16 and x.half().dtype == torch.float16
    assert x.long().dtype == torch.int64 and x.to(torch.float64).dtype == torch.float64
    assert x.to("cpu") is x and x.cpu() is x
    assert float(x.sum()) == pytest.approx(float(X.sum()), rel=1e-5)
    assert f"{x.sum():.3f}" == f"{X.sum():.3f}"
    with pytest.raises(sw.ShardingError, match="to_device"):
        x.to("meta")


def test_like_constructors_keep_the_layout() -> None:
    x = put(X, (S0, S1))
    for fn in (torch.zeros_like, torch.ones_like, torch.empty_like):
        y = fn(x)
        assert y.dist_layout == x.dist_layout and y.shape == x.shape
    assert torch.equal(torch.ones_like(x).to_torch(), torch.ones(4, 6))
    assert torch.equal(torch.full_like(x, 2.5).to_torch(), torch.full((4, 6), 2.5))
    torch.manual_seed(1)
    want = torch.randn_like(X)
    torch.manual_seed(1)
    assert torch.equal(torch.randn_like(x).to_torch(), want)


def test_like_and_new_constructors_never_gather_or_reduce() -> None:
    """``zeros_like(p)`` of a Partial ``p`` and ``x.new_zeros(...)`` read only shapes:
    no fallback (no gather), no reduction; x's shape keeps x's layout without its
    Partial axes (DTensor's rule), another shape is Replicated."""
    from shardwise.debug import CommCounter
    from shardwise.sharding.layout import Layout

    for lay in [(S0, S1), (R, Partial()), (Partial(), S1)]:
        x = put(X, lay)
        keep = x.dist_layout.with_partial((None, None))
        with warnings.catch_warnings(), CommCounter() as counter:
            warnings.simplefilter("error")
            cases = [
                (torch.zeros_like(x), torch.zeros_like(X)),
                (torch.full_like(x, 2.5), torch.full_like(X, 2.5)),
                (x.new_zeros(4, 6), X.new_zeros(4, 6)),
                (x.new_ones((4, 6), dtype=torch.float64), X.new_ones((4, 6), dtype=torch.float64)),
                (x.new_full((4, 6), 7.0), X.new_full((4, 6), 7.0)),
                (x.new_full(size=(4, 6), fill_value=7.0), X.new_full(size=(4, 6), fill_value=7.0)),
                (x.new_empty(size=(4, 6)).zero_(), X.new_zeros(4, 6)),
            ]
            other = [(x.new_zeros(3), X.new_zeros(3)), (x.new_ones(()), X.new_ones(())),
                     (x.new_full([2, 5], -1), X.new_full([2, 5], -1))]
        assert counter.total == 0, counter
        for got, want in cases:
            assert got.dist_layout == keep and got.dtype == want.dtype
            assert torch.equal(got.to_torch(), want)
        for got, want in other:
            assert got.dist_layout == Layout.replicated(x.mesh, want.ndim)
            assert got.dtype == want.dtype and torch.equal(got.to_torch(), want)
    x = put(X, (S0, S1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off_mesh = x.new_zeros(3, device="meta")  # not on the mesh: torch's plain tensor
        assert type(off_mesh) is torch.Tensor and off_mesh.is_meta
        for data in (2.5, [[1, 2], [3, 4]]):
            got, want = x.new_tensor(data), X.new_tensor(data)
            assert got.dist_layout == Layout.replicated(x.mesh, want.ndim)
            assert got.dtype == want.dtype and torch.equal(got.to_torch(), want)
        assert type(x.new_tensor(1.5, device="meta")) is torch.Tensor


def test_flip_and_roll_keep_a_partial_sum_without_communication() -> None:
    from shardwise.debug import CommCounter

    p = put(X, (S0, Partial()))
    with CommCounter() as counter:
        outs = [p.flip(1), torch.roll(p, 1, 1)]
    assert counter.total == 0, counter
    for out, want in zip(outs, [X.flip(1), torch.roll(X, 1, 1)]):
        assert out.dist_layout.is_partial
        torch.testing.assert_close(out.to_torch(), want)


def test_integer_array_indexing_is_an_index_select() -> None:
    x = put(X, (S0, S1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no gather
        for bad in (torch.tensor([4]), [1, -5]):
            with pytest.raises(IndexError, match="out of bounds for dimension 0 with size 4"):
                x[bad]  # torch's error for an index out of range
        with pytest.raises(IndexError, match="out of bounds for dimension 1 with size 6"):
            x[:, [6]]


def test_rope_and_gqa_keep_the_heads_sharded() -> None:
    """torchtitan's Llama attention on head-sharded activations: complex RoPE and
    repeat_interleave of the key/value heads run blockwise, no gather."""
    from shardwise.debug import CommCounter

    q = rnd(2, 4, 4, 8)  # batch, seq, heads, head dim
    freqs = torch.polar(torch.ones(4, 4), rnd(4, 4, seed=5))
    lay = (S0, Sharded(2))

    def rope(x: Any) -> Any:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs.view(1, 4, 1, 4)).flatten(3).type_as(x)

    with warnings.catch_warnings(), CommCounter() as counter:
        warnings.simplefilter("error")
        rotated = rope(put(q, lay))
        repeated = torch.repeat_interleave(put(q, lay), 2, dim=2)
    assert counter.total == 0, counter
    assert rotated.dist_layout == put(q, lay).dist_layout
    torch.testing.assert_close(rotated.to_torch(), rope(q))
    assert torch.equal(repeated.to_torch(), torch.repeat_interleave(q, 2, dim=2))
    assert repeated.dist_layout.dims[2] == (1,)  # heads still split over tp


def test_an_explicit_out_none_is_no_in_place_write() -> None:
    """F.normalize and torch.tensordot pass ``out=None`` down to torch: no write in place,
    so they run (through the fallback, exact) instead of being refused as in-place."""
    x = put(X, (S0, R))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sw.ShardwiseFallbackWarning)
        got = [F.normalize(x, dim=1), torch.tensordot(x, x, dims=([1], [1]))]
    want = [F.normalize(X, dim=1), torch.tensordot(X, X, dims=([1], [1]))]
    for g, w in zip(got, want):
        assert isinstance(g, sw.Tensor)
        torch.testing.assert_close(g.to_torch(), w, rtol=0, atol=0)
    with pytest.raises(sw.ShardingError, match="writes in place"):
        x.put_(torch.tensor([0]), torch.tensor([1.0]))


def test_cat_follows_torch_with_empty_tensors_axis_and_out() -> None:
    """torch.cat skips 1-D empty tensors beside tensors of another rank (it raised a rank
    error); torch.concatenate's ``axis=`` is its dim; ``out=`` is written, never ignored."""
    x = put(X, (S0, R))
    empty = torch.tensor([])
    cases = [(lambda t: torch.cat([t, empty]), X), (lambda t: torch.cat([empty, t], 1), X),
             (lambda t: torch.concatenate([t, t], axis=1), X)]
    for f, plain in cases:
        got, want = f(x), f(plain)
        assert isinstance(got, sw.Tensor) and torch.equal(got.to_torch(), want)
    out = torch.zeros(8, 6)
    assert torch.cat([x, x], out=out) is out
    assert torch.equal(out, torch.cat([X, X]))


def test_sdpa_grouped_query_heads_shard_with_their_kv_heads() -> None:
    """enable_gqa: q has groups x the kv heads; sharding the heads keeps each query
    head's group with its kv head (no gather), for masks and scale, exactly torch's."""
    q, k, v = rnd(2, 4, 6, 8), rnd(2, 2, 6, 8, seed=1), rnd(2, 2, 6, 8, seed=2)
    lays = [(R, R), (S0, S1), (R, S1), (S1, R), (R, S2)]
    for mask in (None, torch.tril(torch.ones(6, 6, dtype=torch.bool)), rnd(2, 1, 6, 6),
                 rnd(2, 4, 6, 6), rnd(1, 1, 1, 6) > 0):
        check(lambda q, k, v, m=mask: F.scaled_dot_product_attention(
            q, k, v, m, scale=0.3, enable_gqa=True), q, k, v, layouts=lays, exact=True)
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                         enable_gqa=True), q, k, v, layouts=lays)
    x = put(q, (R, S1))
    assert F.scaled_dot_product_attention(x, put(k, (R, S1)), put(v, (R, S1)),
                                          enable_gqa=True).placements == (R, S1)
    with pytest.raises(TypeError):  # scale is keyword-only in torch too
        F.scaled_dot_product_attention(x, x, x, None, 0.0, False, 0.3)  # type: ignore[misc]


def test_sdpa_dropout_draws_torchs_noise() -> None:
    q, k, v = rnd(2, 4, 6, 8), rnd(2, 2, 6, 8, seed=1), rnd(2, 2, 6, 8, seed=2)
    for causal in (False, True):
        torch.manual_seed(3)
        ref = F.scaled_dot_product_attention(q, k, v, None, 0.2, causal, enable_gqa=True)
        for lay in [(R, R), (S0, S1), (S1, R)]:
            with warnings.catch_warnings():
                warnings.simplefilter("error", sw.ShardwiseFallbackWarning)
                torch.manual_seed(3)
                out = F.scaled_dot_product_attention(put(q, lay), put(k, lay), put(v, lay),
                                                     None, 0.2, causal, enable_gqa=True)
            assert torch.equal(out.to_torch(), ref), (causal, lay)


def test_pad_isin_addmm_follow_torch() -> None:
    x = rnd(4, 6, 8)
    for args in [((0, 1), "constant", -100.0), ((1, -1, 2, 0), "constant", 0.0),
                 ((2, 2), "reflect", None), ((1, 1, 1, 1), "replicate", None)]:
        check(lambda t, a=args: F.pad(t, *a), x, exact=True)
    ids = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(0))
    check(lambda t: torch.isin(t, torch.tensor([3, 5])), ids, exact=True)
    check(lambda b, a, w: torch.addmm(b, a, w), rnd(6), rnd(4, 8, seed=1), rnd(8, 6, seed=2))


def test_an_advanced_index_write_follows_torch_on_any_target() -> None:
    """``x[idx] = v`` with a tensor index (transformers' MoE ``inv_perm[perm] = arange``)
    writes torch's values into a Replicated or a Sharded target, on a rule."""
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    want = torch.empty_like(perm)
    want[perm] = torch.arange(8)
    for layout in ((R, R), (S0, R)):
        got = put(torch.zeros(8, dtype=torch.long), layout)
        with warnings.catch_warnings():
            warnings.simplefilter("error", sw.ShardwiseFallbackWarning)
            got[put(perm, (R, R))] = torch.arange(8)
        assert torch.equal(got.to_torch(), want)


def test_out_is_written_as_torch_writes_it() -> None:
    """``out=`` on any op: the op runs on its rule, then the result is copied into out
    (relaid out to out's layout; a plain torch out gets the global value, resized as
    torch does); a cast torch refuses and autograd are refused as torch refuses them."""
    x, y = put(X, (S0, R)), put(X, (R, S0))
    for out in (put(torch.zeros_like(X), (R, R)), put(torch.zeros_like(X), (R, S0)),
                torch.zeros_like(X), torch.zeros(0)):
        assert torch.add(x, y, out=out) is out
        got = out.to_torch() if isinstance(out, sw.Tensor) else out
        assert torch.equal(got, X + X)
    total = put(torch.zeros(X.shape[1]), (R, R))
    assert torch.equal(torch.sum(x, 0, out=total).to_torch(), X.sum(0))
    values, indices = put(torch.zeros(X.shape[1]), (R, R)), torch.zeros(X.shape[1]).long()
    torch.max(x, 0, out=(values, indices))
    assert torch.equal(values.to_torch(), X.max(0).values)
    assert torch.equal(indices, X.max(0).indices)
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type Long"):
        torch.add(x, y, out=put(torch.zeros_like(X).long(), (R, R)))
    with pytest.raises(sw.ShardingError, match="keeps its shape"):
        torch.add(x, y, out=put(torch.zeros(X.shape[0]), (R, R)))
    with pytest.raises(RuntimeError, match="automatic differentiation"):
        torch.add(sw.tensor(x, requires_grad=True), y, out=torch.zeros_like(X))


def test_reductions_follow_torch_on_empty_dims_and_0d() -> None:
    """``dim=[]`` reduces every dim (sum, mean, amax, var, count_nonzero...; any/all:
    none), and a 0-d bool sums to int64, as torch: the sum once returned x itself."""
    x = put(X, (S0, R))
    for f in (torch.sum, torch.mean, torch.amax, torch.nansum, torch.var, torch.std,
              torch.count_nonzero):
        got, want = f(x, []), f(X, [])
        assert got.dtype == want.dtype and torch.allclose(got.to_torch(), want), f
    assert torch.equal(torch.any(x.bool(), []).to_torch(), torch.any(X.bool(), []))
    flag = sw.tensor(torch.tensor(True), sharding=PlacementMapping(MESH, [R, R]))
    for f in (torch.sum, torch.count_nonzero):
        assert f(flag).to_torch().dtype == torch.int64
    assert torch.equal(torch.count_nonzero(x, 1).to_torch(), torch.count_nonzero(X, 1))


def test_narrow_index_select_and_resize_follow_torch() -> None:
    """narrow takes a 0-d tensor or negative start and checks its bounds as torch does;
    index_select takes a 0-d index; zero_ and resize_ to the same shape work, a resize
    to another shape is refused by name."""
    x = put(X, (S0, R))
    for start in (1, -3, torch.tensor(-2)):
        got = torch.narrow(x, 0, start, 2).to_torch()
        assert torch.equal(got, torch.narrow(X, 0, start, 2))
    with pytest.raises(RuntimeError, match="exceeds dimension size"):
        x.narrow(0, 2, X.shape[0])
    assert torch.equal(torch.index_select(x, 1, torch.tensor(1)).to_torch(),
                       torch.index_select(X, 1, torch.tensor(1)))
    z = put(X.clone(), (S0, R))
    assert torch.zero_(z) is z and not z.to_torch().any()
    assert z.resize_(X.shape) is z
    with pytest.raises(sw.ShardingError, match="resize_ to"):
        z.resize_(X.numel())


def test_a_shardwise_integer_index_picks_like_index_select() -> None:
    """``x[ids]`` with a 1-D shardwise integer index (transformers' MoE
    ``hidden[perm // k]``) is an index_select on a rule: torch's values, negatives
    counted from the end, torch's IndexError out of range."""
    ids = torch.tensor([3, -1, 0, 2, 2])  # X is 4 x 6
    for lx in ((S0, R), (R, S0), (R, R)):
        for li in ((S0, R), (R, R)):
            x, i = put(X, lx), put(ids, li)
            with warnings.catch_warnings():
                warnings.simplefilter("error", sw.ShardwiseFallbackWarning)
                assert torch.equal(x[i].to_torch(), X[ids])
                assert torch.equal(x[:, i[:3] % 3].to_torch(), X[:, ids[:3] % 3])
    with pytest.raises(IndexError, match="index 99 is out of bounds for dimension 0"):
        put(X, (S0, R))[put(torch.tensor([1, 99]), (R, R))]
