"""Agreement before data: every collective on a process group proves, in a control
message every member sends, that all members call the same collective, and every
wait is bounded by the run's timeout.

The control message of a group is one float64 all_reduce(SUM) of ``room + 2 * CODE``
elements, where ``room`` (``DATA`` to ``CAP``) is chosen from the group's agreed history
alone, so it is the same on every member whatever each one calls now: a disagreement
can never make Gloo abort on a size mismatch, nor mix reduce ops. The history predicts
the next collective's data (the one that followed the same two collectives last time:
a training step repeats), so the room fits it and a step's medium-sized collectives
travel in one Gloo call each; a wrong guess costs bytes, never safety. Its tail carries the
collective's fingerprint (op, reduce op, group, shape, dtype, layout, sizes, and the
group's sequence number) as bytes ``p`` in 1..256, written ``[p, p*p]``: every
member finds ``n * tail`` exactly when all fingerprints are equal (the sum and the
sum of squares of n values are n*p and n*p*p only when all are p: zero variance).
A SUM/AVG all_reduce or reduce_scatter, all_gather or broadcast of a float dtype
that fits the room travels in the first elements of the same message (one Gloo call in
all); every other collective sends a header-only message first, while it prepares
its data. (A MAX or MIN message would not do: with mixed ops each chunk of the
message is reduced by whichever rank's op, and a max of ``p`` beside a min of ``-p``
can pass for agreement.)

Invariants:
- Every message a group's members exchange is either a control message or the data
  of a collective whose control message every member has checked: sizes, dtypes and
  ops then agree, so nothing reaches Gloo with mismatched buffers.
- A message's size depends only on what the group agreed before it (``Channel.room``:
  every member learns the same facts from the same agreed messages, none from a
  mismatch), never on the call at hand.
- Each group (torch ProcessGroup) counts its collectives: the count is in the
  fingerprint and names the position in errors ("collective #k of this group").
  Control messages pair by order, so a member that skipped one is caught by the
  next field that differs (or by the timeout), not by the count itself.
- A mismatch raises :class:`CollectiveError` on every member (all read the same
  reduced tail); the message names the collective, the field and the ranks, read
  from the members' fingerprints in the rendezvous store.
- Waits: control messages, p2p and collectives end within ``timeout_s`` (+ a
  small slack for naming the ranks that did not arrive).
"""

from __future__ import annotations

import datetime
import functools
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardwise.runtime.process import diagnose
from shardwise.runtime.process.world import WORLD
from shardwise.sharding.errors import CollectiveError
from shardwise.sharding.placements import ReduceOp

__all__ = ["CAP", "DATA", "Fingerprint", "agree", "fingerprint", "foldable", "foldable_gather",
           "room", "run", "wait_all"]

DATA = 256            # elements of data every control message has room for (2 KiB as float64)
# The most a predicted message carries (128 KiB as float64). Below it one Gloo round trip
# costs more than the bytes (measured: a 4-rank all_reduce takes the same time from 16 to
# 64Ki elements); above it, data travels natively, at half the bytes for float32.
CAP = 16384
_LEARNED = 4096       # predictions a group keeps (all members forget them at the same call)
CODE = 8              # fingerprint bytes in the tail
_TAIL = 2 * CODE
# on: the agreement runs (default). Off only to measure its cost (``shardwise bench``):
# every process must switch alike, or Gloo pairs a control message with data.
_NOTE_AFTER_S = 1.0   # a control message slower than this leaves a note in the store
_FOLD = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}
_TORCH_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
}
_P = tuple(float(b + 1) for b in range(256))   # byte -> p (never 0)
_PACK = struct.Struct(f"<{_TAIL}d")
_FIRST_WAIT = datetime.timedelta(seconds=_NOTE_AFTER_S)
FIELDS = ("collective", "reduce op", "group", "shape", "dtype", "layout", "sizes")


@dataclass(frozen=True)
class Fingerprint:
    """What a collective call is, as every member must see it."""

    values: tuple[str, ...]   # one per FIELDS entry
    code: int                 # crc32 of the values
    fold: int = 0             # elements it carries in a message with room (0: never)

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
    return Fingerprint(values, zlib.crc32("|".join(values).encode()), fold)


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=WORLD.timeout_s)


class Channel:
    """One process group's agreement state: its control buffers, sequence number and
    what its agreed history predicts."""

    __slots__ = ("device", "key", "last", "learned", "messages", "mismatches", "pg", "ranks",
                 "rooms", "seq")

    def __init__(self, pg: Any, ranks: tuple[int, ...], device: torch.device) -> None:
        self.pg = pg
        self.ranks = tuple(sorted(ranks))
        self.key = "-".join(map(str, self.ranks))
        self.seq = 0
        self.mismatches = 0
        self.device = device
        self.last = (0, 0)    # the codes of the last two agreed collectives
        # last -> the folds of the (at most two) collectives that followed it lately
        self.learned: dict[tuple[int, int], tuple[int, ...]] = {}
        self.rooms: dict[tuple[int, int], int] = {}       # last -> room (powers of two)
        self.messages: dict[int, Message] = {}

    def room(self) -> int:
        """Data elements the next control message has room for (agreed history only):
        the most the collectives that followed the same two last times carried,
        among those that fit ``CAP``."""
        return self.rooms.get(self.last, DATA)

    def agreed(self, fp: Fingerprint) -> None:
        if len(self.learned) >= _LEARNED:
            self.learned.clear()
            self.rooms.clear()
        folds = (*self.learned.get(self.last, ())[-1:], fp.fold)
        self.learned[self.last] = folds
        want = max((f for f in folds if f <= CAP), default=0)
        self.rooms[self.last] = DATA if want <= DATA else 1 << (want - 1).bit_length()
        self.last = (self.last[1], fp.code)

    def message(self, room: int) -> Message:
        msg = self.messages.get(room)
        if msg is None:
            msg = self.messages[room] = Message(room, self.device)
        return msg


class Message:
    """A control buffer with room for ``room`` elements of data, then the tail."""

    __slots__ = ("arr", "buf", "mem", "room")

    def __init__(self, room: int, device: torch.device) -> None:
        self.room = room
        self.buf = torch.zeros(room + _TAIL, dtype=torch.float64, device=device)
        self.arr = self.buf.numpy() if device.type == "cpu" else None
        self.mem = None if self.arr is None else self.arr.data.cast("B")


# WORLD.broken: process groups (by id) on which a wait failed or timed out, with the
# first error: Gloo's state is then unknown (a message may still arrive), so later
# collectives on the group raise at once instead of pairing with stale messages.


def channel(pg: Any, ranks: tuple[int, ...], device: torch.device) -> Channel:
    if device.type == "meta":
        device = torch.device("cpu")
    key = (id(pg), device.type)
    ch = WORLD.channels.get(key)
    if ch is None:
        ch = WORLD.channels[key] = Channel(pg, ranks, device)
    return ch


def room(pg: Any, ranks: tuple[int, ...], device: torch.device) -> int:
    """Data elements the next control message over ``pg`` carries (see
    :meth:`Channel.room`): a collective whose data fits travels inside it."""
    return channel(pg, ranks, device).room()


def reset() -> None:
    WORLD.channels.clear()
    WORLD.broken.clear()


def _broken(pg: Any, err: CollectiveError) -> CollectiveError:
    WORLD.broken.setdefault(id(pg), str(err))
    return err


def _sums(x: torch.Tensor, op: ReduceOp | None) -> bool:
    """The control message (a float64 sum) carries ``x`` exactly: a float dtype that
    float64 holds, and a gather (``op`` None), sum or mean."""
    return x.dtype in _FOLD and op in (None, ReduceOp.SUM, ReduceOp.AVG)


def gather_fold(x: torch.Tensor, total: int) -> int:
    """The elements a gather (or broadcast) of ``total`` elements like ``x`` takes in a
    control message (0: it never travels there)."""
    return total if _sums(x, None) else 0


def reduce_fold(x: torch.Tensor, op: ReduceOp) -> int:
    """The elements an all_reduce of ``x`` by ``op`` takes in a control message (0:
    it never travels there)."""
    return x.numel() if _sums(x, op) else 0


def foldable_gather(x: torch.Tensor, total: int, room: int = DATA) -> bool:
    """True when a gather (or broadcast) of ``total`` elements like ``x`` travels
    inside a control message with ``room`` for data."""
    return _sums(x, None) and total <= room


def foldable(x: torch.Tensor, op: ReduceOp, room: int = DATA) -> bool:
    """True when an all_reduce of ``x`` travels inside a control message with ``room``
    for data: it fits, in a float dtype, and the op is a sum or mean.

    >>> foldable(torch.ones(8, 8), ReduceOp.SUM), foldable(torch.ones(8, 8), ReduceOp.MAX)
    (True, False)
    """
    return _sums(x, op) and x.numel() <= room


def _tail(code: int, seq: int) -> tuple[float, ...]:
    """[p, p*p] for the 8 bytes of (fingerprint code, sequence number)."""
    h = ((code & 0xFFFFFFFF) << 32) | (seq & 0xFFFFFFFF)
    p = [_P[b] for b in h.to_bytes(CODE, "little")]
    return (*p, *[v * v for v in p])


def agree(pg: Any, ranks: tuple[int, ...], label: str, fp: Fingerprint,
          x: torch.Tensor | None = None, op: ReduceOp = ReduceOp.SUM,
          device: torch.device | None = None, place: tuple[int, int] | None = None,
          deferred: list[Any] | None = None) -> torch.Tensor | None:
    """Send one control message over ``pg``: check that every member calls ``fp``
    and, when ``x`` is given (see :func:`foldable`), all_reduce it by ``op`` (SUM or
    AVG) in the same message. Returns the reduced ``x`` (a new tensor) or None.

    ``place=(at, total)``: ``x`` is this member's piece of a gather instead: written
    at element ``at`` of ``total``, -0.0 elsewhere (``x + -0.0`` is ``x`` for every
    float, -0.0 and NaN included), so the sum is the members' pieces, exactly; the
    result is flat (``total`` elements).

    ``deferred`` (a list; header-only messages): return once the message is sent and
    append the wait-and-check to it, so that the caller prepares its data (a 64 MiB
    clone) while the message travels; it must call that before sending any data.

    Raises :class:`CollectiveError` on every member when the fingerprints differ,
    and when a member does not arrive within the timeout.
    """
    if id(pg) in WORLD.broken:
        raise CollectiveError(
            f"{fp.what} over {label} (ranks {sorted(ranks)}) refused on rank "
            f"{dist.get_rank()}: this group failed earlier, and its processes cannot exchange "
            "data reliably any more. Stop the program (or shutdown() and initialize() "
            f"again). The earlier error: {WORLD.broken[id(pg)][:400]}")
    dev = x.device if x is not None else device or _device_of(pg)
    ch = channel(pg, ranks, dev)
    ch.seq += 1
    tail = _tail(fp.code, ch.seq)
    msg = ch.message(ch.room())
    buf, arr, at_tail = msg.buf, msg.arr, msg.room
    fast = arr is not None and x is not None and x.dtype in _NUMPY
    n = at = 0
    if x is not None:
        n = x.numel()
        if place is not None:
            at, total = place
            buf[:total].fill_(-0.0)
        if at + n > msg.room or (place is not None and place[1] > msg.room):
            raise AssertionError(f"{fp.what}: {n} elements do not fit a control message "
                                 f"with room for {msg.room} (check room() first)")
        if fast:  # numpy: a third of torch's per-call cost on tiny tensors
            assert arr is not None
            arr[at:at + n] = (x.detach() if x.requires_grad else x).numpy().reshape(-1)
        else:
            buf[at:at + n].copy_(x.reshape(-1))
    if msg.mem is not None:
        _PACK.pack_into(msg.mem, at_tail * 8, *tail)
    else:
        buf[at_tail:].copy_(torch.tensor(tail, dtype=torch.float64))
    work = _start(lambda: dist.all_reduce(buf, dist.ReduceOp.SUM, group=pg, async_op=True),
                  ch, label, fp)
    if x is None and deferred is not None:  # the caller prepares its data meanwhile
        deferred.append(lambda: _finish(work, ch, msg, label, fp, tail))
        return None
    _finish(work, ch, msg, label, fp, tail)
    if x is None:
        return None
    size = len(ch.ranks)
    if place is not None:
        return buf[:place[1]].to(x.dtype, copy=True)
    if fast:
        assert arr is not None
        got_x = arr[:n] / size if op is ReduceOp.AVG else arr[:n]
        return torch.from_numpy(got_x.astype(_NUMPY[x.dtype]).reshape(tuple(x.shape)))
    out = buf[:n] / size if op is ReduceOp.AVG else buf[:n].clone()
    return out.to(x.dtype).view(x.shape)


def _finish(work: Any, ch: Channel, msg: Message, label: str, fp: Fingerprint,
            tail: tuple[float, ...]) -> None:
    """Wait for a control message (bounded) and check its tail; the group learns the
    collective once agreed (on a mismatch no member learns anything)."""
    _wait_control(work, ch, label, fp)
    got = (_PACK.unpack_from(msg.mem, msg.room * 8) if msg.mem is not None
           else tuple(msg.buf[msg.room:].tolist()))
    size = len(ch.ranks)
    if got != tuple(v * size for v in tail):
        ch.mismatches += 1
        raise CollectiveError(diagnose.mismatch(ch, label, dict(zip(FIELDS, fp.values)),
                                                fp.what))
    ch.agreed(fp)


def _device_of(pg: Any) -> torch.device:
    """Where a header-only message with no data to follow lives (NCCL: this GPU)."""
    if dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _start(fn: Any, ch: Channel, label: str, fp: Fingerprint) -> Any:
    try:
        return fn()
    except RuntimeError as err:
        raise _broken(ch.pg, CollectiveError(
            diagnose.failed_text(ch, label, fp.what, err, [], WORLD.timeout_s))) from err


def _wait_control(work: Any, ch: Channel, label: str, fp: Fingerprint) -> None:
    total = WORLD.timeout_s
    first = min(_NOTE_AFTER_S, total / 2)
    start = time.monotonic()
    try:
        work.wait(timeout=_FIRST_WAIT if first == _NOTE_AFTER_S else
                  datetime.timedelta(seconds=first))
        return
    except RuntimeError as err:
        if "timed out" not in str(err).lower():
            raise _arrival_error(ch, label, fp, err) from err
    diagnose.note(ch)  # slow: say where this rank waits, so the others can name the absent
    try:
        work.wait(timeout=datetime.timedelta(seconds=max(total - (time.monotonic() - start),
                                                         0.01)))
    except RuntimeError as err:
        raise _arrival_error(ch, label, fp, err) from err


def _arrival_error(ch: Channel, label: str, fp: Fingerprint, err: Exception
                   ) -> CollectiveError:
    diagnose.note(ch)
    absent = diagnose.absent(ch)
    return _broken(ch.pg, CollectiveError(
        diagnose.failed_text(ch, label, fp.what, err, absent, WORLD.timeout_s)))


def debug_check(pg: Any, ranks: tuple[int, ...], slot: Any, label: str, fp: Fingerprint
                ) -> None:
    """Debug mode (``check_collectives=True``): compare every member's fingerprint code
    explicitly (one all_gather after the control message), independent of the tail's
    arithmetic. ``slot[p]``: member p's place in torch's rank order (None: the same)."""
    mine = torch.tensor([fp.code], dtype=torch.int64)
    got = torch.empty(len(ranks), dtype=torch.int64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    run(fp.what, label, ranks, lambda: gather(got, mine, group=pg), pg)
    codes = got.tolist()
    others = [ranks[p] for p in range(len(ranks)) if codes[slot[p] if slot else p] != fp.code]
    if others:
        raise CollectiveError(
            f"Collective mismatch (debug check): rank {dist.get_rank()} called {fp.what} over "
            f"{label} ({fp.values}), but ranks {others} called a different collective. "
            "Every process must run the same ops in the same order (check rank-dependent "
            "code)."
        )


# --- bounded waits for the data of an agreed collective -----------------------------------
def run(what: str, label: str, ranks: tuple[int, ...], fn: Any, pg: Any = None) -> Any:
    """Run ``fn`` (a collective whose control message agreed), converting torch's
    errors (a peer died, the group's timeout) into :class:`CollectiveError`; ``pg``
    (when given) is then refused from now on."""
    try:
        return fn()
    except (RuntimeError, ValueError) as err:  # DistBackendError is a RuntimeError
        if isinstance(err, CollectiveError):
            raise
        raise _broken(pg, CollectiveError(
            f"{what} over {label} (ranks {list(ranks)}) failed on rank {dist.get_rank()} "
            "after every member agreed to it: a peer died, stalled past the timeout "
            f"({WORLD.timeout_s:g} s) or closed its connection. Underlying error: "
            f"{str(err)[:300]}"
        )) from err


def wait_all(works: list[Any]) -> None:
    """Wait for point-to-point requests, each bounded by the timeout (Gloo's own
    send/recv wait has none)."""
    limit = timeout()
    for w in works:
        w.wait(timeout=limit)
