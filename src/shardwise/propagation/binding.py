"""Binding a rule of the table to operand shapes: factor ids, sizes, full factors.

Invariants:
- ``bind(op, shapes, *params)`` is pure and cached; its :class:`Factors` is
  hashable and names every operand dim and output dim by a factor id.
- Shapes that do not fit the rule raise a ShardingError naming the op, the
  shapes and the rule; an index out of range raises IndexError.
- ``...`` batch dims broadcast right-aligned; a size-1 dim broadcast against a
  larger one gets its own factor, marked full (never sharded).
- The concrete rule of an op whose rule depends on its arguments comes from the
  builder its :class:`~shardwise.propagation.rules.Rule` holds (``rule.build``): no lookup
  by family name.
- Pure Python, no torch.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any

from shardwise.propagation.rules import RULES, Passes, Rule, normalize_index
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
    # per operand dim / output dim: the product of its minor factors' sizes (1 unless
    # the dim is a compound "(a b)", named by its major factor a)
    extents: tuple[tuple[int, ...], ...] = ()
    out_extents: tuple[int, ...] = ()
    even: frozenset[int] = frozenset()     # majors of compounds: sharded only evenly
    any_partial: bool = False              # every Partial op passes (Rule.any_partial)
    shapes: tuple[tuple[int, ...], ...] = field(init=False, compare=False)
    out_shape: tuple[int, ...] = field(init=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)
    # some size is symbolic (torch.compile's dynamic shapes: tensors/symbolic.py)
    symbolic: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ext = self.extents or tuple((1,) * len(fs) for fs in self.operands)
        out_ext = self.out_extents or (1,) * len(self.output)
        object.__setattr__(self, "shapes", tuple(
            tuple(self.sizes[f] * e for f, e in zip(fs, es))
            for fs, es in zip(self.operands, ext)))
        object.__setattr__(self, "out_shape", tuple(
            self.sizes[f] * e for f, e in zip(self.output, out_ext)))
        symbolic = False
        try:
            h = hash((self.op, self.text, self.sizes))
        except TypeError:  # symbolic sizes (torch.compile's dynamic shapes): never cached,
            h, symbolic = id(self), True  # nor compared (equal sizes would be a guard)
        object.__setattr__(self, "_hash", h)
        object.__setattr__(self, "symbolic", symbolic)

    def __hash__(self) -> int:
        return self._hash


# --- the parser -------------------------------------------------------------------------
# a term's tokens: "...", a compound dim "(a b=4)", or one factor "a!", "k=1"
_TOKENS = re.compile(r"\([^)]*\)|[^\s(]+")


def _fail(op: str, shapes: tuple[tuple[int, ...], ...], spec: str, why: str) -> ShardingError:
    shown = ", ".join(str(list(s)) for s in shapes)
    return ShardingError(f"{op}: operands of shapes {shown} do not fit the rule '{spec}': {why}.")


def _parse(op: str, spec: str, shapes: tuple[tuple[int, ...], ...], rule: Rule) -> Factors:
    lhs, _, rhs = spec.partition("->")
    terms = [_TOKENS.findall(t) for t in lhs.split(",")]
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
    even: set[int] = set()

    def compound(tok: str, size: int | None, where: str) -> tuple[int, int]:
        """A "(a b ...)" dim: its major factor and the product of the minors' sizes."""
        parts = [token(t) for t in tok[1:-1].split()]
        fs = [factor(n, sz, where) for n, _, sz in parts]
        if len(set(fs)) != len(fs) or not fs:
            raise _fail(op, shapes, spec, f"{where}: compound {tok} names a factor twice")
        full.update(fs[1:])
        extent = math.prod(sizes[f] for f in fs[1:])
        if size is not None and sizes[fs[0]] * extent != size:
            raise _fail(op, shapes, spec, f"{where} has size {size}, its factors {tok} "
                                          f"give {sizes[fs[0]] * extent}")
        if extent != 1:
            even.add(fs[0])
        return fs[0], extent

    operands: list[tuple[int, ...]] = []
    extents: list[tuple[int, ...]] = []
    for i, (term, shape, nb) in enumerate(zip(terms, shapes, nbs)):
        dims: list[int] = []
        ext: list[int] = []
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
                    ext.append(1)
                    d += 1
                continue
            if tok.startswith("("):
                f, e = compound(tok, shape[d], f"operand {i} dim {d}")
                dims.append(f)
                ext.append(e)
                d += 1
                continue
            name, must, _ = token(tok)
            f = factor(name, shape[d], f"operand {i} dim {d}")
            if must:
                full.add(f)
            if f in dims:  # a diagonal: both dims of one operand, never sharded
                full.add(f)
            dims.append(f)
            ext.append(1)
            d += 1
        operands.append(tuple(dims))
        extents.append(tuple(ext))
    output: list[int] = []
    out_ext: list[int] = []
    for tok in _TOKENS.findall(rhs):
        if tok == "...":
            output += [factor(f"#{q}", batch[q], "output") for q in range(nbatch)]
            out_ext += [1] * nbatch
            continue
        if tok.startswith("("):
            f, e = compound(tok, None, "output")
            if f in output:
                raise _fail(op, shapes, spec, f"factor of {tok} appears twice in the output")
            output.append(f)
            out_ext.append(e)
            continue
        out_ext.append(1)
        name, must, size = token(tok)
        f = factor(name, size, "output")
        if f in output:
            raise _fail(op, shapes, spec, f"factor {name!r} appears twice in the output")
        if must:
            full.add(f)
        output.append(f)
    inv = {f: n for n, f in names.items()}

    def one(f: int) -> str:
        return inv[f] + ("!" if f in full else "")

    def show(fs: tuple[int, ...] | list[int], toks: list[str], nb: int) -> str:
        shown: list[str] = []
        k = 0
        for tok in toks:
            if tok == "...":
                shown += [one(f) for f in fs[k:k + nb]]
                k += nb
                continue
            if tok.startswith("("):  # a compound dim shows its factors: "(o2 o3!)"
                shown.append("(" + " ".join(one(names[token(t)[0]])
                                            for t in tok[1:-1].split()) + ")")
            else:
                shown.append(one(fs[k]))
            k += 1
        return " ".join(shown)

    text = ", ".join(show(o, t, nb) for o, t, nb in zip(operands, terms, nbs)) + " -> " + \
        show(output, _TOKENS.findall(rhs), nbatch)
    carriers = rule.carriers if rule.carriers is not None else tuple(range(len(shapes)))
    reduce = rule.reduce
    plain = not even and all(e == 1 for es in extents for e in es) and all(
        e == 1 for e in out_ext)
    return Factors(op, text.strip(), tuple(operands), tuple(output), tuple(sizes),
                   frozenset(full), rule.passes, reduce, carriers,
                   () if plain else tuple(extents), () if plain else tuple(out_ext),
                   frozenset(even), rule.any_partial)


@functools.lru_cache(maxsize=8192)
def bind(op: str, shapes: tuple[tuple[int, ...], ...], *params: Any) -> Factors:
    """The rule of ``op`` for operands of ``shapes`` (and the op's arguments).

    >>> bind("matmul", ((4, 8), (8, 2))).text
    'i k, k j -> i j'
    >>> bind("sum", ((4, 8),), (1,), False).text
    'd0 d1 -> d0'
    """
    rule = RULES[op]
    spec = rule.spec if rule.build is None else rule.build(shapes, *params)
    return _parse(op, spec, shapes, rule)
