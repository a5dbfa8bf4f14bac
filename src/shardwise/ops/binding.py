"""Binding a rule of the table to operand shapes: factor ids, sizes, full factors.

Invariants:
- ``bind(op, shapes, *params)`` is pure and cached; its :class:`Factors` is
  hashable and names every operand dim and output dim by a factor id.
- Shapes that do not fit the rule raise a ShardingError naming the op, the
  shapes and the rule; an index out of range raises IndexError.
- ``...`` batch dims broadcast right-aligned; a size-1 dim broadcast against a
  larger one gets its own factor, marked full (never sharded).
- Pure Python, no torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardwise.ops.rules import MATMUL, RULES, Passes, Rule
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.placements import ReduceOp

__all__ = ["Factors", "bind", "normalize_index"]


@dataclass(frozen=True, slots=True)
class Factors:
    """A rule bound to operand shapes: factor ids per operand dim and output dim."""

    op: str
    text: str                              # the concrete rule, e.g. "i k, k j -> i j"
    operands: tuple[tuple[int, ...], ...]  # factor of each dim, per operand
    output: tuple[int, ...]
    sizes: tuple[int, ...]                 # per factor
    full: frozenset[int]                   # factors that must stay replicated
    passes: Passes
    reduce: ReduceOp | None
    carriers: tuple[int, ...]
    out_shape: tuple[int, ...] = field(init=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_shape", tuple(self.sizes[f] for f in self.output))
        object.__setattr__(self, "_hash", hash((self.op, self.text, self.sizes)))

    def __hash__(self) -> int:
        return self._hash


# --- the parser -------------------------------------------------------------------------
def _fail(op: str, shapes: tuple[tuple[int, ...], ...], spec: str, why: str) -> ShardingError:
    shown = ", ".join(str(list(s)) for s in shapes)
    return ShardingError(f"{op}: operands of shapes {shown} do not fit the rule '{spec}': {why}.")


def _parse(op: str, spec: str, shapes: tuple[tuple[int, ...], ...], rule: Rule) -> Factors:
    lhs, _, rhs = spec.partition("->")
    terms = [t.split() for t in lhs.split(",")]
    if len(terms) != len(shapes):
        raise _fail(op, shapes, spec, f"it takes {len(terms)} operands, got {len(shapes)}")
    names: dict[str, int] = {}
    sizes: list[int] = []
    full: set[int] = set()

    def factor(name: str, size: int | None, where: str) -> int:
        f = names.get(name)
        if f is None:
            if size is None:
                raise _fail(op, shapes, spec, f"factor {name!r} has no size")
            f = names[name] = len(sizes)
            sizes.append(size)
        elif size is not None and sizes[f] != size:
            raise _fail(op, shapes, spec, f"{where} has size {size} but factor {name!r} "
                                          f"has size {sizes[f]} elsewhere")
        return f

    def token(tok: str) -> tuple[str, bool, int | None]:
        name, _, size = tok.partition("=")
        must = name.endswith("!")
        return name.rstrip("!"), must, int(size) if size else None

    # batch dims of "...": broadcast right-aligned (numpy rules)
    nbs: list[int] = []
    for i, (term, shape) in enumerate(zip(terms, shapes)):
        named = len(term) - term.count("...")
        nb = len(shape) - named
        if term.count("...") > 1 or (nb < 0 if "..." in term else nb != 0):
            raise _fail(op, shapes, spec, f"operand {i} has rank {len(shape)}, the rule "
                                          f"gives it {named} named dims")
        nbs.append(nb)
    nbatch = max(nbs, default=0)
    batch = [1] * nbatch
    for term, shape, nb in zip(terms, shapes, nbs):
        pos = term.index("...") if "..." in term else 0
        for p in range(nb):
            q, s = nbatch - nb + p, shape[pos + p]
            if s != 1 and batch[q] not in (1, s):
                raise _fail(op, shapes, spec, "batch dims do not broadcast (sizes must "
                                              "match or be 1)")
            if s != 1:
                batch[q] = s
    operands: list[tuple[int, ...]] = []
    for i, (term, shape, nb) in enumerate(zip(terms, shapes, nbs)):
        dims: list[int] = []
        d = 0
        for tok in term:
            if tok == "...":
                for p in range(nb):
                    q = nbatch - nb + p
                    if shape[d] == 1 and batch[q] != 1:  # broadcast: its own, unsharded
                        f = factor(f"#{q}'{i}", 1, f"operand {i} dim {d}")
                        full.add(f)
                    else:
                        f = factor(f"#{q}", shape[d], f"operand {i} dim {d}")
                    dims.append(f)
                    d += 1
                continue
            name, must, _ = token(tok)
            f = factor(name, shape[d], f"operand {i} dim {d}")
            if must:
                full.add(f)
            if f in dims:  # a diagonal: both dims of one operand, never sharded
                full.add(f)
            dims.append(f)
            d += 1
        operands.append(tuple(dims))
    output: list[int] = []
    for tok in rhs.split():
        if tok == "...":
            output += [factor(f"#{q}", batch[q], "output") for q in range(nbatch)]
            continue
        name, must, size = token(tok)
        f = factor(name, size, "output")
        if f in output:
            raise _fail(op, shapes, spec, f"factor {name!r} appears twice in the output")
        if must:
            full.add(f)
        output.append(f)
    inv = {f: n for n, f in names.items()}

    def show(fs: tuple[int, ...] | list[int]) -> str:
        return " ".join(inv[f] + ("!" if f in full else "") for f in fs)

    text = ", ".join(show(o) for o in operands) + " -> " + show(output)
    carriers = rule.carriers if rule.carriers is not None else tuple(range(len(shapes)))
    reduce = rule.reduce
    return Factors(op, text.strip(), tuple(operands), tuple(output), tuple(sizes),
                   frozenset(full), rule.passes, reduce, carriers)


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
    names = [n + ("!" if d == dim else "") for d, n in enumerate(_letters(len(shapes[0])))]
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
        i = j = 0
        while i < len(src) or j < len(new):
            if i < len(src) and src[i] == 1 and (j >= len(new) or new[j] != 1):
                marks[i] = "!"  # a dropped size-1 dim
                i += 1
                continue
            if j < len(new) and new[j] == 1 and (i >= len(src) or src[i] != 1):
                out.append(f"o{j}=1")
                j += 1
                continue
            gi, gj, pi, pj = [i], [j], src[i], new[j]
            i, j = i + 1, j + 1
            while pi != pj:
                if pi < pj:
                    pi *= src[i]
                    gi.append(i)
                    i += 1
                else:
                    pj *= new[j]
                    gj.append(j)
                    j += 1
            if len(gi) == 1 and len(gj) == 1:  # an unchanged dim keeps its factor
                out.append(names[gi[0]])
            else:
                for d in gi:
                    marks[d] = "!"
                out += [f"o{k}!={new[k]}" for k in gj]
    return " ".join(n + m for n, m in zip(names, marks)) + " -> " + " ".join(out)


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


def _embedding(shapes: tuple[tuple[int, ...], ...]) -> str:
    return "..., v! e -> ... e"


def _sdpa(shapes: tuple[tuple[int, ...], ...]) -> str:
    terms = ["... l e!", "... s! e!", "... s! f!"]
    if len(shapes) == 4:  # an attention mask broadcastable to (..., L, S)
        terms.append("... l s!" if len(shapes[3]) >= 2 else "... s!")
    return ", ".join(terms) + " -> ... l f!"


def _index_select(shapes: tuple[tuple[int, ...], ...], dim: int) -> str:
    names = _letters(len(shapes[0]))
    ins = [n + ("!" if d == dim else "") for d, n in enumerate(names)]
    out = ["i" if d == dim else n for d, n in enumerate(names)]
    return " ".join(ins) + ", i -> " + " ".join(out)


_FAMILIES: dict[str, Callable[..., str]] = {
    "elementwise": _elementwise, "normalize": _normalize, "reduce_full": _reduce_full,
    "topk": _topk, "embedding": _embedding, "sdpa": _sdpa, "index_select": _index_select,
    "matmul": _matmul, "einsum": _einsum, "reduce": _reduce, "permute": _permute,
    "softmax": _softmax, "cat": _cat, "reshape": _reshape, "index": _index,
}


@functools.lru_cache(maxsize=8192)
def bind(op: str, shapes: tuple[tuple[int, ...], ...], *params: Any) -> Factors:
    """The rule of ``op`` for operands of ``shapes`` (and the op's arguments).

    >>> bind("matmul", ((4, 8), (8, 2))).text
    'i k, k j -> i j'
    >>> bind("sum", ((4, 8),), (1,), False).text
    'd0 d1 -> d0'
    """
    rule = RULES[op]
    spec = rule.spec if rule.family == "fixed" else _FAMILIES[rule.family](shapes, *params)
    return _parse(op, spec, shapes, rule)
