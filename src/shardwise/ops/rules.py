"""Sharding-propagation rules of the compute ops: one table of data.

Each op names the dims of its operands and of its output by *factors*, in an
einsum-like notation: matmul is ``"... i k, ... k j -> ... i j"``. Propagation
(:mod:`shardwise.ops.propagation`) gives every factor one sharding (a tuple of
mesh axes) and lays each dim out as its factor.

Invariants:
- A factor names dims of equal size. ``...`` stands for broadcast batch dims
  (numpy rules, aligned right); a size-1 dim broadcast against a larger one
  gets a factor of its own that is never sharded.
- ``name!`` marks a factor that must stay replicated ("needs full": softmax's
  dim, cat's dim, reshaped or indexed dims). ``name=size`` gives the size of
  a factor only the output has (cat, reshape, indexing, keepdim).
- A sharded factor missing from the output (matmul's ``k``, a summed dim)
  leaves the output ``Partial(reduce)`` over its mesh axes, with no
  communication: SUM for sum/mean/matmul/einsum, MAX/MIN for amax/amin.
- ``passes``: how Partial(SUM) operands go through, per mesh axis ``a``:
  ``LINEAR`` keeps Partial(SUM) on ``a`` when *all* operands are Partial(SUM)
  on ``a`` (neg, sum, mean, add, sub, layout ops); ``MULTILINEAR`` when
  exactly one operand among ``carriers`` is and the others are replicated on
  ``a`` (mul, matmul, einsum, div by a non-partial denominator);
  ``NONLINEAR`` never: the Partial is resolved first.
- Pure data, no torch: :mod:`shardwise.ops.binding` binds a rule to operand
  shapes (a hashable, cached :class:`~shardwise.ops.binding.Factors`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shardwise.sharding.placements import ReduceOp

__all__ = ["MATMUL", "RULES", "Passes", "Rule"]


class Passes(Enum):
    """How Partial(SUM) operands pass through an op (see the module invariants)."""

    LINEAR = "linear"
    MULTILINEAR = "multilinear"
    NONLINEAR = "nonlinear"


LINEAR, MULTILINEAR, NONLINEAR = Passes.LINEAR, Passes.MULTILINEAR, Passes.NONLINEAR
SUM, MAX, MIN = ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the table. ``spec`` is the factor rule; for the families whose
    rule depends on arguments (dims, shapes, an index) it shows an example and
    the family's builder writes the concrete rule."""

    spec: str
    passes: Passes
    reduce: ReduceOp | None = None
    family: str = "fixed"
    carriers: tuple[int, ...] | None = None  # operands that may carry a Partial; None: all


UNARY, BINARY, TERNARY = "... -> ...", "..., ... -> ...", "..., ..., ... -> ..."

RULES: dict[str, Rule] = {
    # elementwise (numpy broadcasting)
    "neg": Rule(UNARY, LINEAR),
    "relu": Rule(UNARY, NONLINEAR),
    "gelu": Rule(UNARY, NONLINEAR),
    "silu": Rule(UNARY, NONLINEAR),
    "sigmoid": Rule(UNARY, NONLINEAR),
    "tanh": Rule(UNARY, NONLINEAR),
    "exp": Rule(UNARY, NONLINEAR),
    "log": Rule(UNARY, NONLINEAR),
    "sqrt": Rule(UNARY, NONLINEAR),
    "abs": Rule(UNARY, NONLINEAR),
    "add": Rule(BINARY, LINEAR),
    "sub": Rule(BINARY, LINEAR),
    "mul": Rule(BINARY, MULTILINEAR),
    "div": Rule(BINARY, MULTILINEAR, carriers=(0,)),
    "pow": Rule(BINARY, NONLINEAR),
    "maximum": Rule(BINARY, NONLINEAR),
    "minimum": Rule(BINARY, NONLINEAR),
    "eq": Rule(BINARY, NONLINEAR),
    "ne": Rule(BINARY, NONLINEAR),
    "lt": Rule(BINARY, NONLINEAR),
    "le": Rule(BINARY, NONLINEAR),
    "gt": Rule(BINARY, NONLINEAR),
    "ge": Rule(BINARY, NONLINEAR),
    "where": Rule(TERNARY, NONLINEAR),
    # contractions: a sharded k leaves a Partial(SUM)
    "matmul": Rule("... i k, ... k j -> ... i j", MULTILINEAR, SUM, "matmul"),
    "einsum": Rule("b i j, b j k -> b i k", MULTILINEAR, SUM, "einsum"),
    # reductions over dims: a sharded reduced factor leaves a Partial(reduce)
    "sum": Rule("a r b -> a b", LINEAR, SUM, "reduce"),
    "mean": Rule("a r b -> a b", LINEAR, SUM, "reduce"),
    "amax": Rule("a r b -> a b", NONLINEAR, MAX, "reduce"),
    "amin": Rule("a r b -> a b", NONLINEAR, MIN, "reduce"),
    # layout of dims
    "permute": Rule("a b c -> c a b", LINEAR, family="permute"),
    "softmax": Rule("a d! -> a d!", NONLINEAR, family="softmax"),
    "cat": Rule("a0! b, a1! b -> a!=N b", LINEAR, family="cat"),
    "reshape": Rule("a b! c! -> a d!=N", LINEAR, family="reshape"),
    "getitem": Rule("a b! c -> a e=N c", LINEAR, family="index"),
}

# torch-native ops (shardwise.ops.torch_api routes torch functions here)
_NONLINEAR_EW = (
    "rsqrt", "reciprocal", "sin", "cos", "erf", "exp2", "expm1", "log1p", "log2", "log10",
    "floor", "ceil", "round", "trunc", "frac", "sign", "sgn", "square", "logical_not",
    "isnan", "isinf", "isfinite", "bitwise_not", "nan_to_num", "clamp", "clamp_min",
    "clamp_max", "leaky_relu", "elu", "softplus", "hardtanh", "mish", "hardswish",
    "hardsigmoid", "relu6", "logit", "float_power", "fmax", "fmin", "logical_and",
    "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "masked_fill",
    "lerp", "addcmul", "addcdiv", "atan2", "remainder", "fmod", "floor_divide", "copysign",
    "hypot", "xlogy", "threshold", "dropout", "to", "div_rounding", "log_sigmoid",
    "softsign", "tanhshrink",
)
for _name in _NONLINEAR_EW:
    RULES[_name] = Rule(UNARY, NONLINEAR, family="elementwise")
RULES.update({
    "clone": Rule(UNARY, LINEAR, family="elementwise"),
    "ew_linear": Rule(UNARY, LINEAR, family="elementwise"),
    # F.linear without its bias (added after, so a Partial output gets it once)
    "linear": Rule("... k, j k -> ... j", MULTILINEAR, SUM),
    # the normalized trailing dims must be whole: layer_norm, rms_norm
    "normalize": Rule("a n! -> a n!", NONLINEAR, family="normalize"),
    # a reduction that needs its reduced dims whole (var, std, prod, any, all, argmax...)
    "reduce_full": Rule("a r! b -> a b", NONLINEAR, family="reduce_full"),
    # along one whole dim, same shape out: log_softmax, cumsum, cumprod
    "log_softmax": Rule("a d! -> a d!", NONLINEAR, family="softmax"),
    "cumsum": Rule("a d! -> a d!", NONLINEAR, family="softmax"),
    "cumprod": Rule("a d! -> a d!", NONLINEAR, family="softmax"),
    # topk / sort along one whole dim: size k out
    "topk": Rule("a d! -> a k!=K", NONLINEAR, family="topk"),
    # F.embedding(ids, table): the vocabulary whole, the embedding dim may stay sharded
    "embedding": Rule("..., v! e -> ... e", NONLINEAR, family="embedding"),
    # scaled_dot_product_attention over (..., L, E) queries; heads/batch shard freely
    "sdpa": Rule("... l e!, ... s! e!, ... s! f! -> ... l f!", NONLINEAR, family="sdpa"),
    # index_select / gather-style lookups along one whole dim of the source
    # per-sample loss of (N, C) logits: the classes whole (loss parallel keeps them sharded)
    "cross_entropy": Rule("b c!, b -> b", NONLINEAR),
    "index_select": Rule("a d! b, i -> a i b", NONLINEAR, family="index_select"),
})

# matmul by (lhs is 1-D, rhs is 1-D), as torch.matmul
MATMUL = {
    (True, True): "k, k ->",
    (True, False): "k, ... k j -> ... j",
    (False, True): "... i k, k -> ... i",
    (False, False): "... i k, ... k j -> ... i j",
}
