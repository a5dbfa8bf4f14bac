"""A process group's control messages: the fingerprint of a collective call, the tail
that proves every member calls the same one, and the kind of the next message, learned
from what the group agreed before.

A message is one all_reduce of ``room + 2 * CODE`` elements of one dtype by one reduce
op (its :class:`Kind`). Control kinds are float64 sums with room for ``DATA`` to
``CAP`` elements of data (a small or medium collective folds into them). A *fused*
kind is the data message of one all_reduce itself, in its dtype and op, with the tail
appended: a large all_reduce that repeats (the same two collectives came before it the
last two times) then costs one Gloo call, its own.

Invariants:
- The next message's kind depends only on the group's agreed history
  (:meth:`Channel.kind`): every member learns the same facts from the same agreed
  messages, none from a mismatch, so all members send messages of one kind whatever
  each one calls now: Gloo never pairs buffers of different sizes, dtypes or ops. A
  wrong guess costs bytes (a header as long as the guessed data), never safety.
- The tail is exact in every kind's dtype: bytes ``p`` in 1..256, written ``[p, p*p]``
  for a sum (n*p and n*p*p for all n members exactly when all p are equal: zero
  variance) and ``[p, -p]`` for a max or min (max p and min p); the sums stay below
  2**24 for groups of up to 256 members, exact in float32 as in float64.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.runtime.process.world import WORLD
from shardwise.sharding.placements import ReduceOp

__all__ = ["CAP", "DATA", "FIELDS", "Channel", "Fingerprint", "Kind", "Message", "channel",
           "control", "fingerprint", "tails"]

DATA = 256            # elements of data every control message has room for (2 KiB as float64)
# The most a control message carries (128 KiB as float64). Below it one Gloo round trip
# costs more than the bytes (DESIGN's decisions log); above it, data travels natively,
# at half the bytes for float32.
CAP = 16384
_LEARNED = 4096       # predictions a group keeps (all members forget them at the same call)
CODE = 8              # fingerprint and sequence bytes in the tail
TAIL = 2 * CODE
FIELDS = ("collective", "reduce op", "group", "shape", "dtype", "layout", "sizes")
_P = tuple(float(b + 1) for b in range(256))   # byte -> p (never 0)
PACK = struct.Struct(f"<{TAIL}d")
_PACKS = {torch.float64: PACK, torch.float32: struct.Struct(f"<{TAIL}f")}
# A large all_reduce travels as its own message when it repeats: an exact tail needs
# float32 or float64, and a sum, max or min (the tail's two checks).
_FUSE_DTYPES = (torch.float32, torch.float64)
_FUSE_OPS = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN)


@dataclass(frozen=True)
class Kind:
    """What a group's next message is, on every member alike."""

    room: int                        # data elements before the tail
    dtype: torch.dtype = torch.float64
    op: ReduceOp = ReduceOp.SUM
    fused: bool = False              # the data of one predicted all_reduce, not a control


@functools.lru_cache(maxsize=64)
def control(room: int, dtype: torch.dtype = torch.float64) -> Kind:
    return Kind(room, dtype)


_FIRST = control(DATA)   # the kind of a message nothing predicts


@dataclass(frozen=True)
class Fingerprint:
    """What a collective call is, as every member must see it."""

    values: tuple[str, ...]   # one per FIELDS entry
    code: int                 # crc32 of the values
    fold: int = 0             # elements it carries in a control message with room (0: never)
    fuse: Kind | None = None  # the fused kind that carries it (a large all_reduce)
    wire: torch.dtype = torch.float64  # the control dtype its folded data needs

    @property
    def what(self) -> str:
        return self.values[0]


@functools.lru_cache(maxsize=8192)
def fingerprint(what: str, op: ReduceOp | None, group: str, shape: tuple[int, ...],
                dtype: Any, layout: str = "", sizes: tuple[int, ...] = (), fold: int = 0
                ) -> Fingerprint:
    """The fingerprint of one collective call (cached: the hot path is one lookup).
    ``fold``: the elements its data takes in a control message when there is room (the
    same on every member that agrees; 0 for data that never travels there).

    >>> fingerprint("all_reduce", ReduceOp.SUM, "x", (8, 8), torch.float32).values[:2]
    ('all_reduce', 'sum')
    """
    values = (what, "-" if op is None else op.value, group, str(tuple(shape)),
              str(dtype).replace("torch.", ""), layout.strip(), str(tuple(sizes)))
    n = math.prod(shape)
    fuse = (Kind(n, dtype, op, fused=True) if what == "all_reduce" and n > CAP
            and dtype in _FUSE_DTYPES and op in _FUSE_OPS else None)
    wire = torch.float32 if dtype is torch.float32 else torch.float64
    return Fingerprint(values, zlib.crc32("|".join(values).encode()), fold, fuse, wire)


def tails(code: int, seq: int, size: int, op: ReduceOp = ReduceOp.SUM
          ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """A member's tail for (sequence number, fingerprint code), little-endian bytes
    ``p``: ``[p, p*p]`` for a sum, ``[p, -p]`` for a max or min; and the reduced tail
    every member reads when all ``size`` members sent the same (the code's half is
    cached: the hot path computes only the sequence number's).

    >>> mine, want = tails(7, 3, 4)
    >>> mine[:8], want[:8] == tuple(4 * v for v in mine[:8])
    ((4.0, 1.0, 1.0, 1.0, 8.0, 1.0, 1.0, 1.0), True)
    >>> tails(7, 3, 4, ReduceOp.MAX)[1][8:12]
    (-4.0, -1.0, -1.0, -1.0)
    """
    s = seq & 0xFFFFFFFF
    p0, p1, p2, p3 = _P[s & 255], _P[(s >> 8) & 255], _P[(s >> 16) & 255], _P[s >> 24]
    c, c2, w, w2 = _code_half(code & 0xFFFFFFFF, size, op)
    if op is not ReduceOp.SUM:  # max and min: the reduced tail is each member's own
        mine = (p0, p1, p2, p3, *c, -p0, -p1, -p2, -p3, *c2)
        return mine, mine
    q0, q1, q2, q3 = p0 * p0, p1 * p1, p2 * p2, p3 * p3
    return ((p0, p1, p2, p3, *c, q0, q1, q2, q3, *c2),
            (p0 * size, p1 * size, p2 * size, p3 * size, *w,
             q0 * size, q1 * size, q2 * size, q3 * size, *w2))


@functools.lru_cache(maxsize=8192)
def _code_half(code: int, size: int, op: ReduceOp) -> tuple[tuple[float, ...], ...]:
    """The code's half of a tail (``p`` and ``p*p``, or ``-p`` for a max or min), and
    of its reduced tail over ``size`` members."""
    p = tuple(_P[b] for b in code.to_bytes(4, "little"))
    if op is not ReduceOp.SUM:
        neg = tuple(-v for v in p)
        return p, neg, p, neg
    sq = tuple(v * v for v in p)
    return p, sq, tuple(v * size for v in p), tuple(v * size for v in sq)


class Channel:
    """One process group's agreement state: its control buffers, sequence number and
    what its agreed history predicts."""

    __slots__ = ("device", "key", "kinds", "last", "learned", "messages", "mismatches", "pg",
                 "ranks", "seq")

    def __init__(self, pg: Any, ranks: tuple[int, ...], device: torch.device) -> None:
        self.pg = pg
        self.ranks = tuple(sorted(ranks))
        self.key = "-".join(map(str, self.ranks))
        self.seq = 0
        self.mismatches = 0
        self.device = device
        self.last = (0, 0)    # the codes of the last two agreed collectives
        # last -> (fold, wire, fuse) of the (at most two) collectives that followed it
        self.learned: dict[tuple[int, int], tuple[tuple[int, torch.dtype, Kind | None],
                                                  ...]] = {}
        self.kinds: dict[tuple[int, int], Kind] = {}      # last -> the next message's kind
        self.messages: dict[Kind, Message] = {}

    def kind(self) -> Kind:
        """The next message's kind (agreed history only): the fused kind of a large
        all_reduce that followed the same two collectives the last two times, else a
        control message with room for the most that either of them carried, up to CAP
        (``DATA`` when nothing followed them yet)."""
        return self.kinds.get(self.last, _FIRST)

    def room(self, dtype: torch.dtype = torch.float64) -> int:
        """Data elements of ``dtype`` the next control message carries (0: the next
        is fused, or a float32 message and other data)."""
        k = self.kind()
        return 0 if k.fused or (k.dtype is not dtype and k.dtype is torch.float32) else k.room

    def agreed(self, fp: Fingerprint) -> None:
        if len(self.learned) >= _LEARNED:
            self.learned.clear()
            self.kinds.clear()
        seen = self.learned.get(self.last, ())
        new = (fp.fold, fp.wire, fp.fuse)
        if seen != (new, new):  # else: learned already (the steady state)
            follow = self.learned[self.last] = (*seen[-1:], new)
            self.kinds[self.last] = _kind(follow)
        self.last = (self.last[1], fp.code)

    def message(self, kind: Kind) -> Message:
        msg = self.messages.get(kind)
        if msg is None:
            msg = self.messages[kind] = Message(kind.room, kind.dtype, self.device)
        return msg


def _kind(follow: tuple[tuple[int, torch.dtype, Kind | None], ...]) -> Kind:
    fuse = follow[0][2]
    if len(follow) == 2 and fuse is not None and follow[1][2] == fuse:
        return fuse
    # room for the most either carried: a power of two (few buffers), 0 when neither
    # folds (its header then travels alone); float32 when all that fold are float32
    # (the tail is exact there too), so the message is as small as the data's own
    folds = [(f, w) for f, w, _ in follow if 0 < f <= CAP]
    want = max((f for f, _ in folds), default=0)
    wire = torch.float64 if any(w is torch.float64 for _, w in folds) else torch.float32
    return control(1 << (want - 1).bit_length() if want > 1 else want, wire)


class Message:
    """A control buffer with room for ``room`` elements of data, then the tail."""

    __slots__ = ("addr", "arr", "buf", "mem", "pack", "room", "tail_at")

    def __init__(self, room: int, dtype: torch.dtype, device: torch.device) -> None:
        self.room = room
        self.buf = torch.zeros(room + TAIL, dtype=dtype, device=device)
        self.arr = self.buf.numpy() if device.type == "cpu" else None
        self.mem = None if self.arr is None else self.arr.data.cast("B")
        self.pack = _PACKS[dtype]
        self.tail_at = room * self.buf.element_size()   # byte offset of the tail
        self.addr = self.buf.data_ptr()  # the buffer lives as long as the message


def channel(pg: Any, ranks: tuple[int, ...], device: torch.device) -> Channel:
    """The channel of ``pg`` for messages on ``device``'s type (made on first use)."""
    if device.type == "meta":
        device = torch.device("cpu")
    key = (id(pg), device.type)
    ch = WORLD.channels.get(key)
    if ch is None:
        ch = WORLD.channels[key] = Channel(pg, ranks, device)
    return ch
