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

__all__ = ["ELEMENTWISE_LINEAR", "ELEMENTWISE_NONLINEAR", "ELEMENTWISE_RULE", "ELEMENTWISE_SHARED",
           "MATMUL", "RULES", "Passes", "Rule", "normalize_index"]


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


def _sdpa(shapes: tuple[tuple[int, ...], ...], causal: bool, groups: int = 1,
          dropout: bool = False) -> str:
    """Attention ``q (..., Hq, L, E), k (..., Hk, S, E), v (..., Hk, S, F)``, an optional
    mask broadcastable to ``(..., Hq, L, S)`` and (``dropout``) last the dropout noise
    ``(..., Hq, L, S)``. With grouped-query attention (``groups`` = Hq // Hk > 1) the
    query heads are one compound dim ``(h g)``: query head ``i`` reads key/value head
    ``i // groups``, so sharding ``h`` (the key/value heads) carries each query head's
    group along, block for block."""
    q = "l! e!" if causal else "l e!"  # a causal mask is aligned to global positions
    if groups == 1:
        terms = ["... " + q, "... s! e!", "... s! f!"]
        heads = None
    else:
        hk = shapes[1][-3]
        heads = f"(h={hk} g={groups})"
        terms = [f"... {heads} {q}", "... h s! e!", "... h s! f!"]
    if len(shapes) - dropout == 4:  # the mask; a size-1 dim that broadcasts: its own factor
        m = shapes[3]
        ln, sn = shapes[0][-2], shapes[1][-2]
        dims = ["m!" if m[-1] != sn else "s!"]
        if len(m) >= 2:
            dims.insert(0, "ml!" if m[-2] != ln else "l")
        if len(m) >= 3 and heads is not None:
            dims.insert(0, "mh!" if m[-3] == 1 else "(h g)")
        terms.append("... " + " ".join(dims))
    if dropout:
        terms.append("... l s!" if heads is None else "... (h g) l s!")
    out = "l! f!" if causal else "l f!"
    return ", ".join(terms) + (f" -> ... {out}" if heads is None else f" -> ... (h g) {out}")


def _isin(shapes: tuple[tuple[int, ...], ...]) -> str:
    # each element looks itself up in the whole set of test elements
    names = " ".join(_letters(len(shapes[0])))
    return f"{names}, " + " ".join(f"t{d}!" for d in range(len(shapes[1]))) + f" -> {names}"


def _index_select(shapes: tuple[tuple[int, ...], ...], dim: int) -> str:
    names = _letters(len(shapes[0]))
    ins = [n + ("!" if d == dim else "") for d, n in enumerate(names)]
    out = ["i" if d == dim else n for d, n in enumerate(names)]
    return " ".join(ins) + ", i -> " + " ".join(out)


# --- "free_dims" (the nn-layer, fft, indexing and random families): dims that shard freely
def _free_dims(shapes: tuple[tuple[int, ...], ...], free: tuple[tuple[int, ...], ...],
               out: tuple[tuple[int, int], ...]) -> str:
    """Operand ``i``'s dim ``d`` is the shared factor ``f{k}`` when ``free[i][d] == k >= 0``
    (it shards freely: the op treats each of its indices alone, a batch or channel dim)
    and whole (``!``) when it is ``-1``; output dim ``e`` is ``f{k}`` for ``out[e] ==
    (k, size)``, ``k >= 0``, else a whole dim of ``size``. Every ``f{k}`` of the operands
    appears in the output (no reduction, so never a Partial).

    >>> _free_dims(((8, 3, 5), (4, 3, 2)), ((0, -1, -1), (-1, -1, -1)), ((0, 8), (-1, 4), (-1, 4)))
    'f0 w0_1! w0_2!, w1_0! w1_1! w1_2! -> f0 o1!=4 o2!=4'
    """
    terms = [" ".join(f"f{k}" if k >= 0 else f"w{i}_{d}!" for d, k in enumerate(fs[:len(s)]))
             for i, (s, fs) in enumerate(zip(shapes, free))]
    outs = " ".join(f"f{k}" if k >= 0 else f"o{e}!={n}" for e, (k, n) in enumerate(out))
    return ", ".join(terms) + " -> " + outs


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


# --- torch's elementwise ops by name: the one list (shardwise.ops.elementwise registers
# torch.<name>, Tensor.<name>, F.<name> and torch.special.<name> of each, on its rule) ----
#: linear ops (a Partial operand may stay Partial): name -> its rule
ELEMENTWISE_LINEAR = {
    "add": "add", "sub": "sub", "subtract": "sub", "neg": "neg", "negative": "neg",
    "positive": "ew_linear", "mul": "mul", "multiply": "mul", "div": "div",
    "divide": "div", "true_divide": "div"}
#: the other elementwise ops, each its own rule unless ELEMENTWISE_RULE names another
ELEMENTWISE_NONLINEAR = (
    "abs", "relu", "gelu", "silu", "sigmoid", "tanh", "exp", "log", "sqrt", "pow",
    "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "where",
    "rsqrt", "reciprocal", "sin", "cos", "erf", "exp2", "expm1", "log1p", "log2", "log10",
    "floor", "ceil", "round", "trunc", "frac", "sign", "sgn", "square", "logical_not",
    "isnan", "isinf", "isfinite", "bitwise_not", "nan_to_num", "clamp", "clip", "clamp_min",
    "clamp_max", "leaky_relu", "elu", "softplus", "hardtanh", "mish", "hardswish",
    "hardsigmoid", "relu6", "logit", "float_power", "fmax", "fmin", "logical_and",
    "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_left_shift", "bitwise_right_shift", "masked_fill",
    "lerp", "addcmul", "addcdiv", "atan2", "remainder", "fmod", "floor_divide", "copysign",
    "hypot", "xlogy", "threshold", "logsigmoid", "softsign", "tanhshrink", "greater",
    "greater_equal", "less", "less_equal", "not_equal", "absolute", "arctan2",
)
#: torch's other elementwise ops (unary, binary, and (n, x) / (x, p) with a number):
#: each value depends on the elements at its own position only, so they share the rule
#: "elementwise" (issue 20)
ELEMENTWISE_SHARED = (
    "acos", "acosh", "asin", "asinh", "atan", "atanh", "arccos", "arccosh", "arcsin",
    "arcsinh", "arctan", "arctanh", "cosh", "sinh", "tan", "sinc", "deg2rad", "rad2deg",
    "i0", "erfc", "erfinv", "digamma", "lgamma", "mvlgamma", "polygamma", "logaddexp",
    "logaddexp2", "ldexp", "heaviside", "lcm", "gcd", "nextafter", "igamma", "igammac",
    "signbit", "isposinf", "isneginf", "isreal", "isclose", "angle", "conj_physical",
    "complex", "polar", "rsub", "fill", "celu", "selu", "softshrink", "hardshrink", "fix",
    # torch.special's elementwise functions (its other aliases are covered above)
    "i0e", "i1", "i1e", "ndtr", "ndtri", "log_ndtr", "erfcx", "xlog1py", "zeta", "entr",
    "gammaln", "psi", "multigammaln", "gammainc", "gammaincc", "airy_ai", "bessel_j0",
    "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0", "modified_bessel_i1",
    "modified_bessel_k0", "modified_bessel_k1", "scaled_modified_bessel_k0",
    "scaled_modified_bessel_k1", "spherical_bessel_j0", "chebyshev_polynomial_t",
    "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u",
    "shifted_chebyshev_polynomial_v", "shifted_chebyshev_polynomial_w",
    "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
    "legendre_polynomial_p",
)
#: a nonlinear elementwise name -> its rule, where that is not the name itself
ELEMENTWISE_RULE = {
    "clip": "clamp", "absolute": "abs", "arctan2": "atan2", "greater": "gt",
    "greater_equal": "ge", "less": "lt", "less_equal": "le", "not_equal": "ne",
    "logsigmoid": "log_sigmoid", **{n: "elementwise" for n in ELEMENTWISE_SHARED}}
# each name without a rule above gets the n-operand one; so do the rules that handlers
# name themselves (dropout's mask, .to(dtype), div with a rounding mode)
for _name in (*(ELEMENTWISE_RULE.get(n, n) for n in ELEMENTWISE_NONLINEAR),
              "dropout", "to", "div_rounding"):
    if _name not in RULES:
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
    # torch.isin(elements, test_elements): the test elements whole
    "isin": Rule("a, t! -> a", NONLINEAR, build=_isin),
    # index_select along one whole dim of the source
    "index_select": Rule("a d! b, i -> a i b", NONLINEAR, build=_index_select),
    # --- nn layers, fft, indexing, random (ops/free_dims.py): free dims shard, the rest whole
    "free_dims": Rule("f0 w!, f0 -> f0 o!=N", NONLINEAR, build=_free_dims),
})


# --- linalg, the matmul family, statistics and losses (issue 20) -------------------------
def _batched(shapes: tuple[tuple[int, ...], ...], cores: tuple[int, ...],
             out_core: tuple[int, ...]) -> str:
    """Batched linalg: operand ``i`` is ``(..., core dims)`` with its last ``cores[i]``
    dims whole (a matrix, a vector, pivots); the batch dims ``...`` broadcast and shard
    freely; the output is ``(..., out_core)``, its core whole. Every batch element is
    its own problem (det, inv, solve, qr, eigh...), so sharding the batch is exact.

    >>> _batched(((2, 3, 3), (3, 1)), (2, 2), (3, 1))
    '... c0_0! c0_1!, ... c1_0! c1_1! -> ... o0!=3 o1!=1'
    """
    terms = []
    for i, (shape, k) in enumerate(zip(shapes, cores)):
        if k > len(shape):
            raise ShardingError(f"batched linalg: operand {i} of shape {list(shape)} needs "
                                f"at least {k} dims (its matrix or vector dims).")
        terms.append(" ".join(["..."] + [f"c{i}_{j}!" for j in range(k)]))
    return ", ".join(terms) + " -> " + " ".join(
        ["..."] + [f"o{j}!={n}" for j, n in enumerate(out_core)])


def _aligned(shapes: tuple[tuple[int, ...], ...], whole: tuple[int, ...],
             out: tuple[tuple[str, int], ...]) -> str:
    """Operands broadcast right-aligned (numpy) in a frame of ``n = max rank`` dims;
    the frame positions in ``whole`` stay whole in every operand (each operand its own
    factor there, so their sizes may differ: ``diff``'s prepend); every other position
    is one factor that shards freely (a size-1 dim broadcast against a larger one is
    its own, whole). The output names, per dim, ``("b", q)`` the factor of frame
    position ``q`` or ``("n", size)`` a new whole dim (a kept or resized dim).

    >>> _aligned(((4, 3), (3,)), (1,), (("b", 0),))
    'd0 w1_0!, w1_1! -> d0'
    """
    n = max((len(s) for s in shapes), default=0)
    sizes = [1] * n
    for s in shapes:
        for d, size in enumerate(s):
            if size != 1:
                sizes[n - len(s) + d] = size
    terms = []
    for i, s in enumerate(shapes):
        names = []
        for d, size in enumerate(s):
            q = n - len(s) + d
            if q in whole:
                names.append(f"w{q}_{i}!")
            elif size == sizes[q]:
                names.append(f"d{q}")
            else:  # a size-1 dim broadcast against a larger one
                names.append(f"u{q}_{i}!")
        terms.append(" ".join(names))
    outs = []
    for j, (kind, v) in enumerate(out):
        if kind == "b":
            if v in whole:
                raise ShardingError(f"aligned rule: output dim {j} names frame position "
                                    f"{v}, which is whole; give it a new size instead.")
            outs.append(f"d{v}")
        else:
            outs.append(f"n{j}!={v}")
    return ", ".join(terms) + " -> " + " ".join(outs)


def _addend(shape: tuple[int, ...], out: list[tuple[str, int]]) -> str:
    """An operand added to an output of dims ``out`` ((name, size) pairs), broadcast to
    it right-aligned: equal sizes share the output's factor, size-1 dims stay whole."""
    names = []
    for d, size in enumerate(shape):
        name, full = out[len(out) - len(shape) + d]
        names.append(name if size == full else f"u{d}!")
    return " ".join(names)


def _addmm(shapes: tuple[tuple[int, ...], ...], kind: str) -> str:
    """``input + alpha * (op of the others)`` (addmm, addmv, addr, baddbmm, addbmm): the
    contracted dims whole (the input is added once per output element), the rest shard.

    >>> _addmm(((3,), (2, 4), (4, 3)), "addmm")
    'j, i k!, k! j -> i j'
    """
    a, b = shapes[1], shapes[2]
    if kind == "addmm":
        terms, out = ["i k!", "k! j"], [("i", a[0]), ("j", b[1])]
    elif kind == "addmv":
        terms, out = ["i k!", "k!"], [("i", a[0])]
    elif kind == "addr":
        terms, out = ["i", "j"], [("i", a[0]), ("j", b[0])]
    elif kind == "baddbmm":
        terms, out = ["b i k!", "b k! j"], [("b", a[0]), ("i", a[1]), ("j", b[2])]
    else:  # addbmm: the batch is summed too
        terms, out = ["b! i k!", "b! k! j"], [("i", a[1]), ("j", b[2])]
    if len(shapes[0]) > len(out):
        raise ShardingError(f"{kind}: input of shape {list(shapes[0])} does not broadcast "
                            f"to the output's {len(out)} dims.")
    return ", ".join([_addend(shapes[0], out), *terms]) + " -> " + " ".join(
        n for n, _ in out)


def _samples(shapes: tuple[tuple[int, ...], ...], roles: str) -> str:
    """Per-sample losses over ``(N, C, d...)`` inputs (or ``(C,)`` unbatched): role ``x``
    is such an input (its classes whole), ``s`` a tensor of the same shape (soft targets,
    a second input), ``t`` a target ``(N, d...)`` (or ``()``), ``w`` a class weight
    ``(C,)``; for ``linear_cross_entropy``, ``l`` the ``(V, C)`` projection (both whole)
    and ``v`` a ``(V,)`` class weight. Samples and the extra dims shard freely; the output
    is ``(N, d...)``.

    >>> _samples(((8, 5), (8,), (5,)), "xtw")
    'b c! ..., b ..., c! -> b ...'
    """
    batched = len(shapes[0]) > 1
    x = "b c! ..." if batched else "c!"
    t = "b ..." if batched else ""
    terms = {"x": x, "s": x, "t": t, "w": "c!", "l": "v! c!", "v": "v!"}
    return ", ".join(terms[r] for r in roles) + " -> " + t


def _quantile(shapes: tuple[tuple[int, ...], ...], dim: int | None, keepdim: bool,
              nq: int | None) -> str:
    """quantile(x, q, dim): ``dim`` whole (every dim when None); a 1-D ``q`` of ``nq``
    values prepends a dim of that size (its operand whole)."""
    names = _letters(len(shapes[0]))
    ins = [n + ("!" if dim is None or d == dim else "") for d, n in enumerate(names)]
    out = [] if nq is None else [f"q!={nq}"]
    for d, n in enumerate(names):
        if dim is None or d == dim:
            if keepdim:
                out.append(f"k{d}=1")
        else:
            out.append(n)
    terms = [" ".join(ins)] + (["q!"] if len(shapes) > 1 else [])
    return ", ".join(terms) + " -> " + " ".join(out)


def _histc(shapes: tuple[tuple[int, ...], ...], bins: int, whole: bool) -> str:
    """histc: every element counted in one of ``bins`` bins with a fixed range, so a
    sharded dim leaves Partial(SUM) counts; with a range from the data (min == max)
    every dim stays whole."""
    names = _letters(len(shapes[0]))
    return " ".join(n + ("!" if whole else "") for n in names) + f" -> h!={bins}"


_ALONG = "a d! -> a d!"
RULES.update({
    # batch dims shard, matrix/vector dims whole: linalg.inv, solve, qr, eigh, svd...
    "batched": Rule("... a! b!, ... b! c! -> ... o!=N p!=M", NONLINEAR, build=_batched),
    # broadcast operands with some dims whole: cross, cosine_similarity, diff, trapz...
    "aligned": Rule("a w!, w! -> a", NONLINEAR, build=_aligned),
    # input + product: the product's contracted dims whole
    "addmm": Rule("j, i k!, k! j -> i j", NONLINEAR, build=_addmm),
    # products without an addend: a sharded k leaves Partial(SUM)
    "outer": Rule("i, j -> i j", MULTILINEAR, SUM),
    "dot": Rule("k, k ->", MULTILINEAR, SUM),
    "mv": Rule("i k, k -> i", MULTILINEAR, SUM),
    # F.bilinear(x1, x2, W[, b]): the features whole, the out features and batch shard
    "bilinear": Rule("... i!, ... j!, o i! j! -> ... o", NONLINEAR),
    "bilinear_bias": Rule("... i!, ... j!, o i! j!, o -> ... o", NONLINEAR),
    # cdist(x1, x2): points shard, coordinates whole
    "cdist": Rule("... p m!, ... r m! -> ... p r", NONLINEAR),
    # pointwise losses before their reduction (numpy broadcasting)
    "pointwise_loss": Rule(BINARY, NONLINEAR, build=_elementwise),
    # per-sample losses: classes whole, samples shard
    "per_sample": Rule("b c! ..., b ..., c! -> b ...", NONLINEAR, build=_samples),
    # each sample's class weight (weight[target]): the weights whole
    "class_pick": Rule("..., c! -> ...", NONLINEAR),
    "quantile": Rule("a d! -> a", NONLINEAR, build=_quantile),
    # counts over every element: sharded dims leave Partial(SUM) counts
    "histc": Rule("a b -> h!=N", NONLINEAR, SUM, build=_histc),
    # glu halves one whole dim
    "glu": Rule("a d! -> a k!=K", NONLINEAR, build=_topk),
})
# along one whole dim, same shape out (each its own row, for its name in errors)
for _name in ("cummax", "cummin", "logcumsumexp", "softmin", "lp_normalize",
              "safe_softmax", "msort"):
    RULES[_name] = Rule(_ALONG, NONLINEAR, build=_whole_dims)


def _kron(shapes: tuple[tuple[int, ...], ...]) -> str:
    """kron(a, b): output dim ``q`` is the compound ``(a_q b_q)`` (a major, b minor and
    whole), the ranks right-aligned; a's dims shard where their blocks divide evenly.

    >>> _kron(((2, 3), (4, 5)))
    'a0 a1, b0! b1! -> (a0 b0) (a1 b1)'
    """
    a, b = shapes
    n = max(len(a), len(b))
    ta = [f"a{n - len(a) + d}" for d in range(len(a))]
    tb = [f"b{n - len(b) + d}!" for d in range(len(b))]
    out = []
    for q in range(n):
        ha, hb = q >= n - len(a), q >= n - len(b)
        out.append(f"(a{q} b{q})" if ha and hb else f"a{q}" if ha else f"b{q}")
    return " ".join(ta) + ", " + " ".join(tb) + " -> " + " ".join(out)


def _chain(shapes: tuple[tuple[int, ...], ...]) -> str:
    """multi_dot: the chain's outer dims shard (the first's rows, the last's columns),
    the inner dims stay whole (torch picks the product order itself).

    >>> _chain(((4, 3), (3, 5), (5,)))
    'i k0!, k0! k1!, k1! -> i'
    """
    n = len(shapes)
    terms = []
    for m, s in enumerate(shapes):
        left = ("i" if len(s) == 2 else "") if m == 0 else f"k{m - 1}!"
        right = f"k{m}!" if m < n - 1 else ("j" if len(s) == 2 else "")
        if m == 0 and len(s) == 1:
            left, right = "", f"k{m}!"
        if m == n - 1 and len(s) == 1:
            left, right = f"k{m - 1}!", ""
        terms.append(" ".join(t for t in (left, right) if t))
    out = ("i " if len(shapes[0]) == 2 else "") + ("j" if len(shapes[-1]) == 2 else "")
    return ", ".join(terms) + " -> " + out.strip()


def _grouped_mm(shapes: tuple[tuple[int, ...], ...]) -> str:
    """torch._grouped_mm(mat_a, mat_b[, offs]) by the operands' ranks. ``offs`` (G,) ends
    each group at a global index, so the grouped dim and the groups stay whole; the
    other dims shard, and a sharded contracted ``k`` leaves Partial(SUM) like matmul.
    2-D x 3-D: the rows of ``a`` grouped by ``offs``, group ``g`` times ``b[g]``
    (HF's MoE experts: N sharded is column-parallel, K row-parallel); 3-D x 3-D: a
    batched matmul (no ``offs``); 2-D x 2-D: ``a``'s columns and ``b``'s rows grouped,
    one (K, N) product per group; 3-D x 2-D: ``b``'s columns grouped.

    >>> _grouped_mm(((12, 8), (3, 8, 4), (3,)))
    'm! k, g! k n, g! -> m! n'
    >>> _grouped_mm(((3, 5, 8), (3, 8, 4)))
    'g m k, g k n -> g m n'
    """
    ranks = tuple(len(s) for s in shapes)
    rules = {(2, 3, 1): "m! k, g! k n, g! -> m! n",
             (3, 3): "g m k, g k n -> g m n",
             (2, 2, 1): "k m!, m! n, g! -> g! k n",
             (3, 2, 1): "g! m k, k n!, g! -> m n!"}
    if ranks not in rules:
        raise ShardingError(f"grouped_mm: operands of shapes {[list(s) for s in shapes]} "
                            "are none of torch's forms: (M, K) x (G, K, N) with offs (G,), "
                            "(G, M, K) x (G, K, N) without offs, (K, M) x (M, N) or "
                            "(G, M, K) x (K, N) with offs (G,).")
    return rules[ranks]


RULES.update({
    "kron": Rule("a0 a1, b0! b1! -> (a0 b0) (a1 b1)", NONLINEAR, build=_kron),
    "multi_dot": Rule("i k0!, k0! j -> i j", NONLINEAR, build=_chain),
    # torch._grouped_mm (MoE experts): groups whole, a sharded k leaves Partial(SUM)
    "grouped_mm": Rule("m! k, g! k n, g! -> m! n", MULTILINEAR, SUM, _grouped_mm,
                       carriers=(0, 1)),
})

# --- issue 20 (helper ew): the shared elementwise rule -----------------------------------
# torch's other elementwise ops (acos, lgamma, torch.special's functions ...) share it
RULES["elementwise"] = Rule(UNARY, NONLINEAR, build=_elementwise)


def _diagonal(shapes: tuple[tuple[int, ...], ...], dim1: int, dim2: int, length: int) -> str:
    """torch.diagonal: ``dim1``/``dim2`` whole (a diagonal crosses every block of
    them); the other dims keep their order, then the diagonal, of ``length``."""
    names = _letters(len(shapes[0]))
    ins = [n + "!" if d in (dim1, dim2) else n for d, n in enumerate(names)]
    out = [n for d, n in enumerate(names) if d not in (dim1, dim2)] + [f"g!={length}"]
    return " ".join(ins) + " -> " + " ".join(out)


def _diag_embed(shapes: tuple[tuple[int, ...], ...], dim1: int, dim2: int, size: int) -> str:
    """torch.diag_embed: the last dim whole becomes a (size, size) matrix whose dims
    sit at ``dim1``/``dim2`` of the output (normalized, distinct)."""
    names = _letters(len(shapes[0]))
    out = names[:-1]
    for d, n in sorted(((dim1, "e1"), (dim2, "e2"))):
        out.insert(d, f"{n}!={size}")
    return " ".join([*names[:-1], names[-1] + "!"]) + " -> " + " ".join(out)


def _unfold(shapes: tuple[tuple[int, ...], ...], dim: int, windows: int, size: int) -> str:
    """Tensor.unfold: ``dim`` whole becomes its ``windows``; the window's elements are a
    new last dim of ``size`` (windows overlap block boundaries)."""
    names = _letters(len(shapes[0]))
    ins = [n + "!" if d == dim else n for d, n in enumerate(names)]
    out = [f"w!={windows}" if d == dim else n for d, n in enumerate(names)]
    return " ".join(ins) + " -> " + " ".join([*out, f"s!={size}"])


def _scatter(shapes: tuple[tuple[int, ...], ...], kind: str, dim1: int, dim2: int) -> str:
    """select_/slice_/diagonal_scatter(x, src): x's written dims whole (positions are
    global), src's matching dims whole too; the others shard alike."""
    names = _letters(len(shapes[0]))
    whole = (dim1,) if kind != "diagonal" else (dim1, dim2)
    x = [n + "!" if d in whole else n for d, n in enumerate(names)]
    if kind == "select":
        src = [n for d, n in enumerate(names) if d != dim1]
    elif kind == "slice":
        src = ["m!" if d == dim1 else n for d, n in enumerate(names)]
    else:
        src = [n for d, n in enumerate(names) if d not in whole] + ["g!"]
    return f"{' '.join(x)}, {' '.join(src)} -> {' '.join(x)}"


def _expand(shapes: tuple[tuple[int, ...], ...], target: tuple[int, ...]) -> str:
    """Tensor.expand to ``target`` (resolved): a dim of equal size keeps its factor; a
    broadcast size-1 dim is whole and its output dim a new factor, as the new leading
    dims (each block of a broadcast is a broadcast of the one element)."""
    src = shapes[0]
    lead = len(target) - len(src)
    names = _letters(len(src))
    ins, out = [], [f"n{j}={target[j]}" for j in range(lead)]
    for d, (a, b) in enumerate(zip(src, target[lead:])):
        if a == b:
            ins.append(names[d])
            out.append(names[d])
        else:
            ins.append(names[d] + "!")
            out.append(f"b{d}={b}")
    return " ".join(ins) + " -> " + " ".join(out)


def _one_hot(shapes: tuple[tuple[int, ...], ...], classes: int) -> str:
    """F.one_hot: every dim keeps its factor; the classes are a new last dim."""
    names = " ".join(_letters(len(shapes[0])))
    return f"{names} -> {names} c={classes}"


def _prelu(shapes: tuple[tuple[int, ...], ...]) -> str:
    """F.prelu(x, weight): a weight of one slope per channel follows x's dim 1; a single
    slope (0-d, or one element) broadcasts."""
    x, w = shapes
    names = _letters(len(x))
    if len(w) == 1 and w[0] != 1 and len(x) >= 2:
        return f"{' '.join(names)}, d1 -> {' '.join(names)}"
    return f"{' '.join(names)}, {'k!' if w else ''} -> {' '.join(names)}"


RULES.update({
    "prelu": Rule("a c b, c -> a c b", NONLINEAR, build=_prelu),
    "one_hot": Rule("a -> a c=C", NONLINEAR, build=_one_hot),
    "expand": Rule("a k! -> n=N a b=B", LINEAR, build=_expand),
    # selections and embeddings: Partial(SUM) passes (each output element is one input
    # element, or a zero)
    "diagonal": Rule("a d1! d2! -> a g!=L", LINEAR, build=_diagonal),
    "diag_embed": Rule("a n! -> a e1!=N e2!=N", LINEAR, build=_diag_embed),
    "unfold": Rule("a d! -> a w!=W s!=S", LINEAR, build=_unfold),
    "scatter": Rule("a d! b, a b -> a d! b", LINEAR, build=_scatter),
})
# --- end of issue 20 (helper ew) section -------------------------------------------------
