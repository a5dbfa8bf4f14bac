"""Agreement before data: every collective on a process group proves, in a control
message every member sends, that all members call the same collective, and every
wait is bounded by the run's timeout.

The control message of a group is one float64 all_reduce(SUM) of fixed length
``DATA + 2 * CODE`` (the same bytes and op on every member, so a disagreement can
never make Gloo abort on a size mismatch, nor mix reduce ops). Its tail carries the
collective's fingerprint (op, reduce op, group, shape, dtype, layout, sizes, and the
group's sequence number) as bytes ``p`` in 1..256, written ``[p, p*p]``: every
member finds ``n * tail`` exactly when all fingerprints are equal (the sum and the
sum of squares of n values are n*p and n*p*p only when all are p: zero variance).
A small SUM/AVG all_reduce or reduce_scatter, all_gather or broadcast of a float
dtype travels in the first ``DATA`` elements of the same message (one Gloo call in
all); every other collective sends a header-only message first, while it prepares
its data. (A MAX or MIN message would not do: with mixed ops each chunk of the
message is reduced by whichever rank's op, and a max of ``p`` beside a min of ``-p``
can pass for agreement.)

Invariants:
- Every message a group's members exchange is either a control message or the data
  of a collective whose control message every member has checked: sizes, dtypes and
  ops then agree, so nothing reaches Gloo with mismatched buffers.
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

__all__ = ["DATA", "Fingerprint", "agree", "fingerprint", "foldable", "foldable_gather", "run",
           "wait_all"]

DATA = 256            # elements of data a control message carries (2 KiB as float64)
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

    @property
    def what(self) -> str:
        return self.values[0]


@functools.lru_cache(maxsize=8192)
def fingerprint(what: str, op: ReduceOp | None, group: str, shape: tuple[int, ...],
                dtype: Any, layout: str = "", sizes: tuple[int, ...] = ()) -> Fingerprint:
    """The fingerprint of one collective call (cached: the hot path is one lookup).

    >>> fingerprint("all_reduce", ReduceOp.SUM, "x", (8, 8), torch.float32).values[:2]
    ('all_reduce', 'sum')
    """
    values = (what, "-" if op is None else op.value, group, str(tuple(shape)),
              str(dtype).replace("torch.", ""), layout.strip(), str(tuple(sizes)))
    return Fingerprint(values, zlib.crc32("|".join(values).encode()))


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=WORLD.timeout_s)


class Channel:
    """One process group's agreement state: its control buffer and sequence number."""

    __slots__ = ("arr", "buf", "key", "mem", "mismatches", "pg", "ranks", "seq")

    def __init__(self, pg: Any, ranks: tuple[int, ...], device: torch.device) -> None:
        self.pg = pg
        self.ranks = tuple(sorted(ranks))
        self.key = "-".join(map(str, self.ranks))
        self.seq = 0
        self.mismatches = 0
        self.buf = torch.zeros(DATA + _TAIL, dtype=torch.float64, device=device)
        self.arr = self.buf.numpy() if device.type == "cpu" else None
        self.mem = None if self.arr is None else self.arr.data.cast("B")


# WORLD.broken: process groups (by id) on which a wait failed or timed out, with the
# first error: Gloo's state is then unknown (a message may still arrive), so later
# collectives on the group raise at once instead of pairing with stale messages.


def channel(pg: Any, ranks: tuple[int, ...], device: torch.device) -> Channel:
    key = (id(pg), device.type)
    ch = WORLD.channels.get(key)
    if ch is None:
        ch = WORLD.channels[key] = Channel(pg, ranks, device)
    return ch


def reset() -> None:
    WORLD.channels.clear()
    WORLD.broken.clear()


def _broken(pg: Any, err: CollectiveError) -> CollectiveError:
    WORLD.broken.setdefault(id(pg), str(err))
    return err


def foldable_gather(x: torch.Tensor, total: int) -> bool:
    """True when a gather (or broadcast) of ``total`` elements like ``x`` travels
    inside the control message (a float dtype that float64 holds exactly)."""
    return total <= DATA and x.dtype in _FOLD


def foldable(x: torch.Tensor, op: ReduceOp) -> bool:
    """True when an all_reduce of ``x`` travels inside the control message: small,
    a float dtype that float64 holds exactly, a sum or mean (the message is summed)."""
    return x.numel() <= DATA and x.dtype in _FOLD and op in (ReduceOp.SUM, ReduceOp.AVG)


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
    ch = channel(pg, ranks, dev if dev.type != "meta" else torch.device("cpu"))
    ch.seq += 1
    tail = _tail(fp.code, ch.seq)
    buf, arr = ch.buf, ch.arr
    fast = arr is not None and x is not None and x.dtype in _NUMPY
    n = at = 0
    if x is not None:
        n = x.numel()
        if place is not None:
            at, total = place
            buf[:total].fill_(-0.0)
        if fast:  # numpy: a third of torch's per-call cost on tiny tensors
            assert arr is not None
            arr[at:at + n] = (x.detach() if x.requires_grad else x).numpy().reshape(-1)
        else:
            buf[at:at + n].copy_(x.reshape(-1))
    if ch.mem is not None:
        _PACK.pack_into(ch.mem, DATA * 8, *tail)
    else:
        buf[DATA:].copy_(torch.tensor(tail, dtype=torch.float64))
    work = _start(lambda: dist.all_reduce(buf, dist.ReduceOp.SUM, group=pg, async_op=True),
                  ch, label, fp)
    if x is None and deferred is not None:  # the caller prepares its data meanwhile
        deferred.append(lambda: _finish(work, ch, label, fp, tail))
        return None
    _finish(work, ch, label, fp, tail)
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


def _finish(work: Any, ch: Channel, label: str, fp: Fingerprint, tail: tuple[float, ...]
            ) -> None:
    """Wait for a control message (bounded) and check its tail."""
    _wait_control(work, ch, label, fp)
    got = (_PACK.unpack_from(ch.mem, DATA * 8) if ch.mem is not None
           else tuple(ch.buf[DATA:].tolist()))
    size = len(ch.ranks)
    if got != tuple(v * size for v in tail):
        ch.mismatches += 1
        raise CollectiveError(diagnose.mismatch(ch, label, dict(zip(FIELDS, fp.values)),
                                                fp.what))


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
