"""The program position of a collective: which module asked for it (and through which
parallel style or ``fully_shard`` unit) and which op was running, so that every
member's fingerprint names *where* in the program a collective was issued, not only
what it is. Two ranks that run different programs (one lays a layer out row-wise,
the others column-wise) then disagree at their first divergent collective, even
when it has the same op, shape, dtype and layout as the one the others call.

Invariants:
- The position is per thread (autograd runs a CPU backward on the calling thread):
  a :class:`Site` (module path, style, forward or backward; interned, its code
  computed once) and the op being run (a torch function, or a short string such as
  ``"input 0"``), both set and restored around the code they cover, so a rank that
  runs extra local ops (a log line) leaves nothing behind for the next collective.
- Outside any parallelized module the site is :data:`ROOT`; outside any dispatched
  op the op is None: every rank of an SPMD program is in the same place then too.
- :func:`code` (the hot path: every collective) reads two cached ints; no string is
  built. :func:`text` (errors only) formats the position.
- A backward collective carries its forward's position, marked as the backward of it
  (:func:`backward_of`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["HERE", "ROOT", "Site", "at", "backward_of", "code", "current", "issuing", "op_name",
           "pop", "push", "site", "text"]

_MIX = 0x9E3779B1  # an odd constant: the op's code is spread before it joins the site's


@dataclass(frozen=True, slots=True)
class Site:
    """Where a collective was asked for: a module path and how it is parallelized.

    >>> s = site("layers.0.mlp.fc1", "ColwiseParallel linear")
    >>> str(s), s is site("layers.0.mlp.fc1", "ColwiseParallel linear")
    ('layers.0.mlp.fc1 (ColwiseParallel linear)', True)
    >>> str(backward_of(s))
    'backward of layers.0.mlp.fc1 (ColwiseParallel linear)'
    """

    module: str
    style: str = ""
    backward: bool = False
    code: int = 0

    def __str__(self) -> str:
        where = self.module or "the top level"
        where += f" ({self.style})" if self.style else ""
        return f"backward of {where}" if self.backward else where


@functools.cache
def site(module: str, style: str = "", backward: bool = False) -> Site:
    """The interned site of ``module`` (its path from the parallelized root)."""
    key = f"{module}|{style}|{'b' if backward else 'f'}".encode()
    return Site(module, style, backward, zlib.crc32(key))


ROOT = site("")


def backward_of(s: Site) -> Site:
    """The site a backward collective of ``s``'s forward carries."""
    return site(s.module, s.style, True)


class _Here(threading.local):
    site: Site = ROOT
    op: Any = None

    def __init__(self) -> None:
        self.stack: list[Site] = []


HERE = _Here()
"""This thread's position. Hot paths (the dispatch, hooks) set and restore its ``op``
and ``site`` directly; other code uses :func:`at`, :func:`issuing`, :func:`push`."""
_OPS: dict[Any, int] = {None: 0}


def op_name(op: Any) -> str:
    """A readable name of an op (a torch function, or a string already)."""
    if op is None:
        return ""
    if isinstance(op, str):
        return op
    return str(getattr(op, "__name__", None) or op)


def _op_code(op: Any) -> int:
    c = (zlib.crc32(op_name(op).encode()) * _MIX) & 0xFFFFFFFF
    with contextlib.suppress(TypeError):  # an unhashable callable: named each time
        _OPS[op] = c
    return c


def code() -> int:
    """The current position's 32-bit code (what the fingerprint's tail carries).

    >>> with issuing("sum"):
    ...     inside = code()
    >>> inside == code()  # the op is restored on leaving
    False
    """
    here = HERE
    op = here.op
    try:
        c = _OPS.get(op)
    except TypeError:
        c = None
    if c is None:
        c = _op_code(op)
    return here.site.code ^ c


def text() -> str:
    """The current position in words (for error messages).

    >>> with at(site("layers.0.attn", "RowwiseParallel linear")), issuing("output"):
    ...     text()
    'layers.0.attn (RowwiseParallel linear) in output'
    >>> text()
    'the top level'
    """
    here = HERE
    name = op_name(here.op)
    return f"{here.site} in {name}" if name else str(here.site)


def current() -> tuple[Site, Any]:
    """The current (site, op): what a Function saves for its backward."""
    return HERE.site, HERE.op


def push(s: Site) -> None:
    """Enter ``s`` (a module's forward pre-hook); :func:`pop` leaves it."""
    here = HERE
    here.stack.append(here.site)
    here.site = s


def pop() -> None:
    here = HERE
    here.site = here.stack.pop() if here.stack else ROOT


@contextmanager
def at(s: Site) -> Iterator[None]:
    """Run the body at site ``s`` (the op is kept)."""
    here = HERE
    before = here.site
    here.site = s
    try:
        yield
    finally:
        here.site = before


@contextmanager
def issuing(op: Any) -> Iterator[None]:
    """Run the body as op ``op`` (a torch function or a short fixed string)."""
    here = HERE
    before = here.op
    here.op = op
    try:
        yield
    finally:
        here.op = before
