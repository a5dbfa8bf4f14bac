"""Sharding-propagation rules of the compute ops: one table of data.

Each op names the dims of its operands and of its output by *factors*, in an
einsum-like notation: matmul is ``"... i k, ... k j -> ... i j"``. Propagation
(:mod:`shardwise.propagation.decide`) gives every factor one sharding (a tuple of
mesh axes) and lays each dim out as its factor.

Invariants:
- A factor names dims of equal size. ``...`` stands for broadcast batch dims
  (numpy rules, aligned right); a size-1 dim broadcast against a larger one
  gets a factor of its own that is never sharded.
- ``name!`` marks a factor that must stay replicated ("needs full": softmax's
  dim, cat's dim, indexed dims). ``name=size`` gives the size of a factor only
  the output has (cat, reshape, indexing, keepdim).
- ``(a b)`` is one dim made of factors ``a`` (major) and ``b`` (reshape's split,
  merged and regrouped dims): the dim is laid out as ``a``, the minor factors stay
  replicated, and ``a`` may be sharded only where its pieces divide evenly (then
  the dim's contiguous blocks are exactly ``a``'s blocks times the minors).
  Reshape's rule alone decides which dims keep their sharding: every dim it
  keeps sharded is reshaped block by block, with no communication.
- A sharded factor missing from the output (matmul's ``k``, a summed dim)
  leaves the output ``Partial(reduce)`` over its mesh axes, with no
  communication: SUM for sum/mean/matmul/einsum, MAX/MIN for amax/amin.
- ``passes``: how Partial(SUM) operands go through, per mesh axis ``a``:
  ``LINEAR`` keeps Partial(SUM) on ``a`` when *all* operands are Partial(SUM)
  on ``a`` (neg, sum, mean, add, sub, layout ops); ``MULTILINEAR`` when
  exactly one operand among ``carriers`` is and the others are replicated on
  ``a`` (mul, matmul, einsum, div by a non-partial denominator);
  ``NONLINEAR`` never: the Partial is resolved first. ``any_partial`` (reshape
  and cat, which only move elements): under ``LINEAR`` a Partial of *any* reduce
  op passes, not only SUM (the max of moved blocks is the moved max).
- A rule that depends on the op's arguments (dims, shapes, an index) holds its
  family's builder (``Rule.build``), defined in this module right above the
  table: ``build(shapes, *params)`` writes the concrete factor rule.
- Pure Python, no torch: :mod:`shardwise.propagation.binding` parses a rule bound to
  operand shapes (a hashable, cached :class:`~shardwise.propagation.binding.Factors`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from shardwise.sharding.errors import ShardingError
from shardwise.sharding.placements import ReduceOp
from shardwise.sharding.shapes import reshape_groups

__all__ = ["MATMUL", "RULES", "Passes", "Rule", "normalize_index"]


class Passes(Enum):
    """How Partial(SUM) operands pass through an op (see the module invariants)."""

    LINEAR = "linear"
    MULTILINEAR = "multilinear"
    NONLINEAR = "nonlinear"


LINEAR, MULTILINEAR, NONLINEAR = Passes.LINEAR, Passes.MULTILINEAR, Passes.NONLINEAR
SUM, MAX, MIN = ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN


# A family builder: (operand shapes, *op arguments) -> the concrete factor rule.
Builder = Callable[..., str]


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the table. ``spec`` is the factor rule; for the families whose
    rule depends on arguments (dims, shapes, an index) it shows an example and
    ``build``, the family's builder, writes the concrete rule.

    >>> RULES["sum"].build(((4, 8),), (1,), False)
    'd0 d1 -> d0'
    >>> RULES["add"].build is None and RULES["add"].spec
    '..., ... -> ...'
    """

    spec: str
    passes: Passes
    reduce: ReduceOp | None = None
    build: Builder | None = None             # None: ``spec`` is the rule for any shapes
    carriers: tuple[int, ...] | None = None  # operands that may carry a Partial; None: all
    any_partial: bool = False                # Partial(MAX/MIN/...) passes as SUM does


# matmul by (lhs is 1-D, rhs is 1-D), as torch.matmul
MATMUL = {
    (True, True): "k, k ->",
    (True, False): "k, ... k j -> ... j",
    (False, True): "... i k, k -> ... i",
    (False, False): "... i k, ... k j -> ... i j",
}


# --- family builders: arguments -> concrete rule ----------------------------------------
def _letters(n: int, start: int = 0) -> list[str]:
    return [f"d{i}" for i in range(start, start + n)]


def _matmul(shapes: tuple[tuple[int, ...], ...]) -> str:
    a, b = shapes
    if not a or not b:
        raise ShardingError(f"matmul: both operands need at least one dim. Got shapes "
                            f"{list(a)} and {list(b)}; use mul for scalars.")
    return MATMUL[(len(a) == 1, len(b) == 1)]


def _einsum(shapes: tuple[tuple[int, ...], ...], equation: str) -> str:
    def spaced(term: str) -> str:  # torch's notation: one letter per dim, spaces ignored
        term = term.replace(" ", "")
        out, i = [], 0
        while i < len(term):
            if term.startswith("...", i):
                out.append("...")
                i += 3
            else:
                if not term[i].isalpha():
                    raise ShardingError(f"einsum: cannot read {equation!r}: use letters, "
                                        "'...', ',' and '->' (e.g. 'bij,bjk->bik').")
                out.append(term[i])
                i += 1
        return " ".join(out)

    lhs, arrow, rhs = equation.partition("->")
    ins = [spaced(t) for t in lhs.split(",")]
    if not arrow:  # implicit output: letters used once, sorted; batch dims first
        toks = [t for term in ins for t in term.split() if t != "..."]
        once = sorted(t for t in set(toks) if toks.count(t) == 1)
        rhs = " ".join((["..."] if any("..." in t for t in ins) else []) + once)
    return ", ".join(ins) + " -> " + spaced(rhs)


def _reduce(shapes: tuple[tuple[int, ...], ...], dims: tuple[int, ...], keepdim: bool) -> str:
    names = _letters(len(shapes[0]))
    out = []
    for d, n in enumerate(names):
        if d not in dims:
            out.append(n)
        elif keepdim:
            out.append(f"k{d}=1")
    return " ".join(names) + " -> " + " ".join(out)


def _permute(shapes: tuple[tuple[int, ...], ...], perm: tuple[int, ...]) -> str:
    names = _letters(len(shapes[0]))
    if sorted(perm) != list(range(len(names))):
        raise ShardingError(f"permute: {list(perm)} is not a permutation of the "
                            f"{len(names)} dims of shape {list(shapes[0])}.")
    return " ".join(names) + " -> " + " ".join(names[p] for p in perm)


def _softmax(shapes: tuple[tuple[int, ...], ...], dim: int) -> str:
    return _whole_dims(shapes, (dim,))


def _as_complex(shapes: tuple[tuple[int, ...], ...]) -> str:
    names = _letters(len(shapes[0]) - 1)
    return " ".join([*names, "z!"]) + " -> " + " ".join(names)


def _as_real(shapes: tuple[tuple[int, ...], ...]) -> str:
    names = _letters(len(shapes[0]))
    return " ".join(names) + " -> " + " ".join([*names, "z=2"])


def _whole_dims(shapes: tuple[tuple[int, ...], ...], dims: tuple[int, ...]) -> str:
    names = [n + ("!" if d in dims else "") for d, n in enumerate(_letters(len(shapes[0])))]
    return " ".join(names) + " -> " + " ".join(names)


def _cat(shapes: tuple[tuple[int, ...], ...], dim: int) -> str:
    rank = len(shapes[0])
    names = _letters(rank)
    terms = []
    for i, s in enumerate(shapes):
        if len(s) != rank:
            raise ShardingError(f"cat: every tensor needs rank {rank} like the first; "
                                f"tensor {i} has shape {list(s)}.")
        terms.append(" ".join(f"c{i}!" if d == dim else n for d, n in enumerate(names)))
    total = sum(s[dim] for s in shapes)
    out = " ".join(f"c!={total}" if d == dim else n for d, n in enumerate(names))
    return ", ".join(terms) + " -> " + out


def _reshape(shapes: tuple[tuple[int, ...], ...], target: tuple[int, ...]) -> str:
    src = shapes[0]
    new = list(target)
    numel = math.prod(src)
    if new.count(-1) > 1 or any(s < -1 for s in new):
        raise ShardingError(f"reshape: {list(target)} may hold one -1 and sizes >= 0.")
    if -1 in new:
        rest = math.prod(s for s in new if s != -1)
        if rest == 0 or numel % rest:
            raise ShardingError(f"reshape: cannot infer -1 in {list(target)} for a tensor "
                                f"of shape {list(src)} ({numel} elements).")
        new[new.index(-1)] = numel // rest
    if math.prod(new) != numel:
        raise ShardingError(f"reshape: shape {list(src)} ({numel} elements) cannot become "
                            f"{list(target)} ({math.prod(new)} elements).")
    names = _letters(len(src))
    out: list[str] = []
    marks = [""] * len(src)
    if tuple(new) == src:
        return " ".join(names) + " -> " + " ".join(names)
    if numel == 0:  # no groups to align: every dim is new
        marks = ["!"] * len(src)
        out = [f"o{j}!={s}" for j, s in enumerate(new)]
    else:
        for gi, gj in reshape_groups(src, new):
            if not gj:
                marks[gi[0]] = "!"  # a dropped size-1 dim
            elif not gi:
                out.append(f"o{gj[0]}=1")
            elif len(gi) == 1 and len(gj) == 1:  # an unchanged dim keeps its factor
                out.append(names[gi[0]])
            elif len(gi) == 1:  # a split: the dim is the new dims' compound (major first)
                names[gi[0]] = "(" + " ".join(f"o{k}={new[k]}" for k in gj) + ")"
                out += [f"o{k}" for k in gj]
            elif len(gj) == 1:  # a merge: the new dim is the old dims' compound
                out.append("(" + " ".join(names[d] for d in gi) + ")")
            else:
                out += _regroup(src, new, gi, gj, names, marks)
    return " ".join(n + m for n, m in zip(names, marks)) + " -> " + " ".join(out)


def _regroup(src: tuple[int, ...], new: list[int], gi: list[int], gj: list[int],
             names: list[str], marks: list[str]) -> list[str]:
    """A run regrouped, neither a split nor a merge (``(6, 4) -> (4, 6)``): its first
    source and first target dim share a major factor ``m`` of size ``g = gcd`` of the
    two, their rests are minors, and the run's other dims stay whole. ``m`` sharded
    over ``n`` devices (``n`` dividing ``g``, the compound's "only evenly") leaves
    device ``k`` the ``k``-th contiguous ``1/n`` of the run on both sides. Coprime
    first dims give ``g == 1``: only size-1 mesh axes may shard ``m`` then."""
    a, b = src[gi[0]], new[gj[0]]
    g = math.gcd(a, b)
    for d in gi[1:]:
        marks[d] = "!"
    m = f"m{gi[0]}"
    # a side whose first dim is m itself (g equals it) names m alone: one of a, b
    # differs from g, since a run whose first dims agree would be a single dim
    names[gi[0]] = m if g == a else f"({m}={g} {names[gi[0]]}={a // g})"
    first = m if g == b else f"({m} o{gj[0]}={b // g})"
    return [first] + [f"o{k}!={new[k]}" for k in gj[1:]]


def normalize_index(index: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[Any, ...]:
    """A basic index as one item per position: ``("full",)``, ``("slice", start,
    stop, step)``, ``("int", i)`` (non-negative) or ``("new",)`` (None). Slices
    arrive as ``("slice", start, stop, step)`` tuples (slices are unhashable)."""
    consumed = sum(1 for it in index if it is not None and it is not Ellipsis)
    if consumed > len(shape):
        raise IndexError(f"getitem: too many indices ({consumed}) for a tensor of shape "
                         f"{list(shape)}.")
    if sum(1 for it in index if it is Ellipsis) > 1:
        raise IndexError("getitem: an index can only have a single ellipsis ('...').")
    out: list[Any] = []
    d = 0
    for it in index:
        if it is Ellipsis:
            for _ in range(len(shape) - consumed):
                out.append(("full",))
                d += 1
        elif it is None:
            out.append(("new",))
        elif isinstance(it, int):
            size = shape[d]
            if not -size <= it < size:
                raise IndexError(f"getitem: index {it} is out of bounds for dim {d} of "
                                 f"size {size} (shape {list(shape)}).")
            out.append(("int", it % size))
            d += 1
        else:
            start, stop, step = slice(*it[1:]).indices(shape[d])
            if step <= 0:
                raise ShardingError(f"getitem: slice steps must be positive, got {step}.")
            whole = start == 0 and stop == shape[d] and step == 1
            out.append(("full",) if whole else ("slice", start, stop, step))
            d += 1
    out += [("full",)] * (len(shape) - d)
    return tuple(out)


def _index(shapes: tuple[tuple[int, ...], ...], index: tuple[Any, ...]) -> str:
    shape = shapes[0]
    names = _letters(len(shape))
    ins, out = [], []
    d = 0
    for j, it in enumerate(normalize_index(index, shape)):
        if it[0] == "new":
            out.append(f"n{j}=1")
            continue
        if it[0] == "full":
            ins.append(names[d])
            out.append(names[d])
        elif it[0] == "int":
            ins.append(names[d] + "!")
        else:
            ins.append(names[d] + "!")
            out.append(f"s{d}={len(range(it[1], it[2], it[3]))}")
        d += 1
    return " ".join(ins) + " -> " + " ".join(out)


UNARY, BINARY, TERNARY = "... -> ...", "..., ... -> ...", "..., ..., ... -> ..."

def _elementwise(shapes: tuple[tuple[int, ...], ...]) -> str:
    return ", ".join("..." for _ in shapes) + " -> ..."


def _normalize(shapes: tuple[tuple[int, ...], ...], k: int) -> str:
    """x (..., n1..nk) and optional weight/bias (n1..nk): the last k dims whole."""
    names = [f"n{i}!" for i in range(k)]
    terms = ["... " + " ".join(names)] + [" ".join(names)] * (len(shapes) - 1)
    return ", ".join(terms) + " -> ... " + " ".join(names)


def _reduce_full(shapes: tuple[tuple[int, ...], ...], dims: tuple[int, ...],
                 keepdim: bool) -> str:
    names = _letters(len(shapes[0]))
    ins = [n + ("!" if d in dims else "") for d, n in enumerate(names)]
    out = [n if d not in dims else f"k{d}=1" for d, n in enumerate(names)
           if d not in dims or keepdim]
    return " ".join(ins) + " -> " + " ".join(out)


def _topk(shapes: tuple[tuple[int, ...], ...], dim: int, k: int) -> str:
    names = _letters(len(shapes[0]))
    ins = [n + ("!" if d == dim else "") for d, n in enumerate(names)]
    out = [f"t!={k}" if d == dim else n for d, n in enumerate(names)]
    return " ".join(ins) + " -> " + " ".join(out)


def _sdpa(shapes: tuple[tuple[int, ...], ...], causal: bool) -> str:
    # a causal mask is aligned to global positions: with it the queries stay whole too
    terms = ["... l! e!" if causal else "... l e!", "... s! e!", "... s! f!"]
    if len(shapes) == 4:  # an attention mask broadcastable to (..., L, S)
        terms.append("... l s!" if len(shapes[3]) >= 2 else "... s!")
    return ", ".join(terms) + (" -> ... l! f!" if causal else " -> ... l f!")


def _index_select(shapes: tuple[tuple[int, ...], ...], dim: int) -> str:
    names = _letters(len(shapes[0]))
    ins = [n + ("!" if d == dim else "") for d, n in enumerate(names)]
    out = ["i" if d == dim else n for d, n in enumerate(names)]
    return " ".join(ins) + ", i -> " + " ".join(out)


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
    "matmul": Rule("... i k, ... k j -> ... i j", MULTILINEAR, SUM, _matmul),
    "einsum": Rule("b i j, b j k -> b i k", MULTILINEAR, SUM, _einsum),
    # reductions over dims: a sharded reduced factor leaves a Partial(reduce)
    "sum": Rule("a r b -> a b", LINEAR, SUM, _reduce),
    "mean": Rule("a r b -> a b", LINEAR, SUM, _reduce),
    "amax": Rule("a r b -> a b", NONLINEAR, MAX, _reduce),
    "amin": Rule("a r b -> a b", NONLINEAR, MIN, _reduce),
    # layout of dims
    "permute": Rule("a b c -> c a b", LINEAR, build=_permute),
    "softmax": Rule("a d! -> a d!", NONLINEAR, build=_softmax),
    "cat": Rule("a0! b, a1! b -> a!=N b", LINEAR, build=_cat, any_partial=True),
    "reshape": Rule("a (h=4 e=8) -> a h e", LINEAR, build=_reshape, any_partial=True),
    "getitem": Rule("a b! c -> a e=N c", LINEAR, build=_index),
}


# torch-native ops (shardwise.ops.torch_api routes torch functions here)
_NONLINEAR_EW = (
    "rsqrt", "reciprocal", "sin", "cos", "erf", "exp2", "expm1", "log1p", "log2", "log10",
    "floor", "ceil", "round", "trunc", "frac", "sign", "sgn", "square", "logical_not",
    "isnan", "isinf", "isfinite", "bitwise_not", "nan_to_num", "clamp", "clamp_min",
    "clamp_max", "leaky_relu", "elu", "softplus", "hardtanh", "mish", "hardswish",
    "hardsigmoid", "relu6", "logit", "float_power", "fmax", "fmin", "logical_and",
    "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_left_shift", "bitwise_right_shift", "masked_fill",
    "lerp", "addcmul", "addcdiv", "atan2", "remainder", "fmod", "floor_divide", "copysign",
    "hypot", "xlogy", "threshold", "dropout", "to", "div_rounding", "log_sigmoid",
    "softsign", "tanhshrink",
)
for _name in _NONLINEAR_EW:
    RULES[_name] = Rule(UNARY, NONLINEAR, build=_elementwise)
RULES.update({
    "clone": Rule(UNARY, LINEAR, build=_elementwise),
    "ew_linear": Rule(UNARY, LINEAR, build=_elementwise),
    # F.linear without its bias (added after, so a Partial output gets it once)
    "linear": Rule("... k, j k -> ... j", MULTILINEAR, SUM),
    # the normalized trailing dims must be whole: layer_norm, rms_norm, tril/triu
    "normalize": Rule("a n! -> a n!", NONLINEAR, build=_normalize),
    # a reduction that needs its reduced dims whole (var, std, prod, any, all, argmax...)
    "reduce_full": Rule("a r! b -> a b", NONLINEAR, build=_reduce_full),
    # along one whole dim, same shape out
    "log_softmax": Rule("a d! -> a d!", NONLINEAR, build=_softmax),
    "cumsum": Rule("a d! -> a d!", NONLINEAR, build=_softmax),
    "cumprod": Rule("a d! -> a d!", NONLINEAR, build=_softmax),
    # topk along one whole dim: size k out; sort along one whole dim
    "topk": Rule("a d! -> a k!=K", NONLINEAR, build=_topk),
    "sort": Rule("a d! -> a d!", NONLINEAR, build=_softmax),
    # element order along whole dims (a permutation: Partial passes through)
    "flip": Rule("a d! -> a d!", LINEAR, build=_whole_dims),
    "roll": Rule("a d! -> a d!", LINEAR, build=_whole_dims),
    # complex views: the (real, imaginary) pair is one whole dim of size 2
    "view_as_complex": Rule("a z! -> a", LINEAR, build=_as_complex),
    "view_as_real": Rule("a -> a z=2", LINEAR, build=_as_real),
    # F.embedding(ids, table): the vocabulary whole, the embedding dim may stay sharded
    "embedding": Rule("..., v! e -> ... e", NONLINEAR),
    # scaled_dot_product_attention over (..., L, E) queries; heads/batch shard freely
    "sdpa": Rule("... l e!, ... s! e!, ... s! f! -> ... l f!", NONLINEAR, build=_sdpa),
    # per-sample loss of (N, C) logits: the classes whole (loss parallel keeps them sharded)
    "cross_entropy": Rule("b c!, b -> b", NONLINEAR),
    # index_select along one whole dim of the source
    "index_select": Rule("a d! b, i -> a i b", NONLINEAR, build=_index_select),
})
