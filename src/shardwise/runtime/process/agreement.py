"""Agreement before data: every collective on a process group proves, in a message
every member sends, that all members call the same collective, and every wait is
bounded by the run's timeout.

The message (see :mod:`.channel`) is one all_reduce whose kind (length, dtype, op) the
group's agreed history alone decides, so it is the same on every member whatever each
one calls now: a disagreement can never make Gloo abort on a size mismatch, nor mix
reduce ops. Its tail carries the collective's fingerprint (op, reduce op, group, shape,
dtype, layout, sizes, and the group's sequence number) joined with the program position
that issued it (:mod:`shardwise.runtime.position`: the module, its style and the op;
one XOR of cached codes): every member finds the expected reduced tail exactly when
all fingerprints and positions are equal, so a divergent program stops at its first
divergent collective, before its data is used.
- A control message (float64 sum) carries a SUM/AVG all_reduce or reduce_scatter, an
  all_gather or a broadcast of a float dtype when it fits the room the history
  predicted (a training step repeats: from its second iteration a step's small and
  medium collectives travel in one Gloo call each).
- A repeated large all_reduce (float32/64; sum, max or min) is its own message: the
  data with the tail appended, in its dtype and op (one Gloo call).
- Every other collective sends a header-only message first, while it prepares its
  data, and its data after the check.

Invariants:
- Every message a group's members exchange is either a message of the kind the
  history decided or the data of a collective whose message every member has
  checked: sizes, dtypes and ops then agree, so nothing reaches Gloo with mismatched
  buffers. Data reduced inside a message is returned only after its tail checked.
- Each group (torch ProcessGroup) counts its collectives: the count is in the
  fingerprint and names the position in errors ("collective #k of this group").
  Messages pair by order, so a member that skipped one is caught by the next field
  that differs (or by the timeout), not by the count itself.
- A mismatch raises :class:`CollectiveError` on every member (all read the same
  reduced tail); the message names the collective, the field and the ranks, read
  from the members' fingerprints in the rendezvous store, and where each member
  issued it when the positions differ.
- Waits: messages, p2p and collectives end within ``timeout_s`` (+ at most
  ``3 * diagnose.SLACK_S + 2 * diagnose.BYSTANDER_S + 0.5`` s for naming the ranks that
  did not arrive and the culprit behind them, whatever the store's host does: frozen,
  dead or slow; a rank that names no bystander chain takes at most
  ``2 * diagnose.SLACK_S + 0.5``).
"""

from __future__ import annotations

import ctypes
import datetime
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardwise.runtime import buffers, position
from shardwise.runtime.process import diagnose
from shardwise.runtime.process.channel import (  # re-exported: the runtime reaches them here
    CAP,
    DATA,
    FIELDS,
    TAIL,
    Channel,
    Fingerprint,
    Kind,
    Message,
    channel,
    fingerprint,
    tails,
)
from shardwise.runtime.process.p2p_backends import message_device
from shardwise.runtime.process.world import WORLD
from shardwise.sharding.errors import CollectiveError
from shardwise.sharding.placements import ReduceOp

__all__ = ["CAP", "DATA", "FIELDS", "Channel", "Fingerprint", "Kind", "agree", "agree_fused",
           "fingerprint", "foldable", "foldable_gather", "kind", "room", "run", "tails",
           "wait_all"]

_NOTE_AFTER_S = 1.0   # a message slower than this leaves a note in the store
_FOLD = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}
_TORCH_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
}
_FIRST_WAIT = datetime.timedelta(seconds=_NOTE_AFTER_S)
_OPTIONS: dict[ReduceOp, Any] = {}  # reduce op -> AllreduceOptions (one per op, reused)
_memmove = ctypes.memmove


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=WORLD.timeout_s)


def kind(pg: Any, ranks: tuple[int, ...], device: torch.device) -> Kind:
    """The kind of the next message over ``pg`` (see :meth:`.channel.Channel.kind`)."""
    return channel(pg, ranks, device).kind()


def room(pg: Any, ranks: tuple[int, ...], x: torch.Tensor) -> int:
    """Elements like ``x`` the next control message over ``pg`` carries (0: none; see
    :meth:`.channel.Channel.room`): a collective whose data fits travels inside it."""
    return channel(pg, ranks, x.device).room(x.dtype)


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


def _refuse_broken(pg: Any, ranks: tuple[int, ...], label: str, fp: Fingerprint) -> None:
    if id(pg) in WORLD.broken:
        raise CollectiveError(
            f"{fp.what} over {label} (ranks {sorted(ranks)}) refused on rank "
            f"{dist.get_rank()}: this group failed earlier, and its processes cannot exchange "
            "data reliably any more. Stop the program (or shutdown() and initialize() "
            f"again). The earlier error: {WORLD.broken[id(pg)][:400]}")


def agree(pg: Any, ranks: tuple[int, ...], label: str, fp: Fingerprint,
          x: torch.Tensor | None = None, op: ReduceOp = ReduceOp.SUM,
          device: torch.device | None = None, place: tuple[int, int] | None = None,
          deferred: list[Any] | None = None) -> torch.Tensor | None:
    """Send one message over ``pg``: check that every member calls ``fp`` and, when
    ``x`` is given (it must fit :func:`room`, see :func:`foldable`), all_reduce it by
    ``op`` (SUM or AVG) in the same control message. Returns the reduced ``x`` (a new
    tensor) or None.

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
    _refuse_broken(pg, ranks, label, fp)
    ch = channel(pg, ranks, x.device if x is not None else device or message_device(pg))
    ch.seq += 1
    k = ch.kind()
    if k.fused:  # a header as long as the predicted all_reduce (it is not this call)
        if x is not None:
            raise AssertionError(f"{fp.what}: the next message is a fused all_reduce "
                                 "(check room() first)")
        mine, want = tails(fp.code ^ position.code(), ch.seq, len(ch.ranks), k.op)
        buf = torch.zeros(k.room + TAIL, dtype=k.dtype, device=ch.device)
        buf[k.room:].copy_(torch.tensor(mine, dtype=k.dtype))
        _send(ch, buf, k, label, fp, want, deferred)
        return None
    msg = ch.message(k)
    if x is not None and k.dtype is torch.float32 and x.dtype is not torch.float32:
        raise AssertionError(f"{fp.what}: {x.dtype} data does not fit a float32 control "
                             "message (check room_for() first)")
    size = len(ch.ranks)
    mine, want = tails(fp.code ^ position.code(), ch.seq, size)
    buf, arr = msg.buf, msg.arr
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
        msg.pack.pack_into(msg.mem, msg.tail_at, *mine)
    else:
        buf[msg.room:].copy_(torch.tensor(mine, dtype=k.dtype))
    if x is None:
        _send(ch, buf, k, label, fp, want, deferred, msg)
        return None
    work = _post(ch, buf, k.op, label, fp)
    if fast and place is None:
        out = torch.empty(tuple(x.shape), dtype=x.dtype)
        _finish(work, ch, buf, k, label, fp, want, msg)
        assert arr is not None
        if op is ReduceOp.AVG:
            np.divide(arr[:n], size, out=out.numpy().reshape(-1), casting="unsafe")
        else:
            out.numpy().reshape(-1)[:] = arr[:n]
        return out
    _finish(work, ch, buf, k, label, fp, want, msg)
    if place is not None:
        return buf[:place[1]].to(x.dtype, copy=True)
    res = buf[:n] / size if op is ReduceOp.AVG else buf[:n].clone()
    return res.to(x.dtype).view(x.shape)


def fold_reduce(ch: Channel, label: str, fp: Fingerprint, x: torch.Tensor, op: ReduceOp,
                kind: Kind) -> torch.Tensor:
    """all_reduce a small float32/float64 CPU ``x`` by SUM or AVG inside the group's
    next control message (``kind`` = :meth:`Channel.kind`, whose room fits ``x``): what
    :func:`agree` does for it, written flat (the hot path of every small all_reduce).
    Returns a new tensor."""
    if id(ch.pg) in WORLD.broken:
        _refuse_broken(ch.pg, ch.ranks, label, fp)
    ch.seq += 1
    msg = ch.messages.get(kind) or ch.message(kind)
    arr, n, size = msg.arr, x.numel(), len(ch.ranks)
    assert arr is not None and msg.mem is not None
    # The same dtype on the wire: a byte copy each way (memmove), which costs about half
    # of numpy's views and copy here, where every call runs on a cache the wait left cold.
    raw = x.dtype is msg.buf.dtype and buffers.by_address(x)
    if raw:
        _memmove(msg.addr, x.data_ptr(), n * x.element_size())
    else:
        arr[:n] = (x.detach() if x.requires_grad else x).numpy().reshape(-1)
    mine, want = tails(fp.code ^ position.code(), ch.seq, size)
    msg.pack.pack_into(msg.mem, msg.tail_at, *mine)
    work = _post(ch, msg.buf, ReduceOp.SUM, label, fp)
    out = torch.empty(tuple(x.shape), dtype=x.dtype)  # while the message travels
    _wait_control(work, ch, label, fp)
    if msg.pack.unpack_from(msg.mem, msg.tail_at) != want:
        ch.mismatches += 1
        raise CollectiveError(diagnose.mismatch(ch, label, _fields(fp), fp.what))
    ch.agreed(fp)
    if op is ReduceOp.AVG:
        np.divide(arr[:n], size, out=out.numpy().reshape(-1), casting="unsafe")
    elif raw:
        _memmove(out.data_ptr(), msg.addr, n * x.element_size())
    else:
        out.numpy().reshape(-1)[:] = arr[:n]
    return out


def agree_fused(pg: Any, ranks: tuple[int, ...], label: str, fp: Fingerprint,
                x: torch.Tensor) -> torch.Tensor:
    """all_reduce ``x`` as the fused message the group expects next (``fp.fuse`` must be
    :func:`kind`): its data with the tail appended, reduced by its own op in one Gloo
    call; the tail is checked before the result is returned (a new tensor)."""
    _refuse_broken(pg, ranks, label, fp)
    ch = channel(pg, ranks, x.device)
    ch.seq += 1
    k = ch.kind()
    if fp.fuse != k:
        raise AssertionError(f"{fp.what}: not the fused all_reduce the group expects "
                             "(check kind() first)")
    mine, want = tails(fp.code ^ position.code(), ch.seq, len(ch.ranks), k.op)
    out = buffers.empty((k.room + TAIL,), x)
    out[:k.room].view(x.shape).copy_(x)
    out[k.room:].copy_(torch.tensor(mine, dtype=k.dtype))
    _send(ch, out, k, label, fp, want)
    return out[:k.room].view(x.shape)


def _send(ch: Channel, buf: torch.Tensor, k: Kind, label: str, fp: Fingerprint,
          want: tuple[float, ...], deferred: list[Any] | None = None,
          msg: Message | None = None) -> None:
    """all_reduce one message of kind ``k``, then wait and check it (or append the
    wait-and-check to ``deferred``)."""
    work = _post(ch, buf, k.op, label, fp)
    if deferred is not None:  # the caller prepares its data meanwhile
        deferred.append(lambda: _finish(work, ch, buf, k, label, fp, want, msg))
        return
    _finish(work, ch, buf, k, label, fp, want, msg)


def _finish(work: Any, ch: Channel, buf: torch.Tensor, k: Kind, label: str, fp: Fingerprint,
            want: tuple[float, ...], msg: Message | None) -> None:
    """Wait for a message (bounded) and check its tail against ``want``; the group
    learns the collective once agreed (on a mismatch no member learns anything)."""
    _wait_control(work, ch, label, fp)
    got = (msg.pack.unpack_from(msg.mem, msg.tail_at) if msg is not None and msg.mem is not None
           else tuple(buf[k.room:].tolist()))
    if got != want:
        ch.mismatches += 1
        raise CollectiveError(diagnose.mismatch(ch, label, _fields(fp), fp.what))
    ch.agreed(fp)


def _fields(fp: Fingerprint) -> dict[str, str]:
    """This member's view of a mismatched collective, for the error: the fingerprint's
    fields and the program position that issued it (formatted here, off the hot path)."""
    return {**dict(zip(FIELDS, fp.values)), diagnose.POSITION: position.text()}


def _post(ch: Channel, buf: torch.Tensor, op: ReduceOp, label: str, fp: Fingerprint) -> Any:
    """Start one message's all_reduce: the process group's own call (what
    ``dist.all_reduce`` ends in, without its per-call checks: this buffer is ours)."""
    opts = _OPTIONS.get(op)
    if opts is None:
        opts = _OPTIONS[op] = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(_TORCH_OP[op])
    pg = ch.pg if ch.pg is not None else dist.distributed_c10d._get_default_group()
    try:
        return pg.allreduce([buf], opts)
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
            raise _arrival_error(ch, label, fp, err, start) from err
    # slow: say where this rank waits (and since when), so the others name the absent
    diagnose.note(ch, fp.what, time.monotonic() - start)
    try:
        work.wait(timeout=datetime.timedelta(seconds=max(total - (time.monotonic() - start),
                                                         0.01)))
    except RuntimeError as err:
        raise _arrival_error(ch, label, fp, err, start) from err
    diagnose.note_done()  # it arrived late: no longer waiting (a stale note would mislead)


def _arrival_error(ch: Channel, label: str, fp: Fingerprint, err: Exception, start: float
                   ) -> CollectiveError:
    """The error of a wait that failed: who did not arrive (and whom they wait for), read
    from the store under its own deadline; the time is the wait's real length."""
    elapsed = time.monotonic() - start
    diagnose.note(ch, fp.what, elapsed)
    seen = diagnose.examine(ch, fp.what)
    return _broken(ch.pg, CollectiveError(
        diagnose.failed_text(ch, label, fp.what, err, seen, WORLD.timeout_s, elapsed)))


def debug_check(pg: Any, ranks: tuple[int, ...], slot: Any, label: str, fp: Fingerprint
                ) -> None:
    """Debug mode (``check_collectives=True``): compare every member's fingerprint code
    explicitly (one all_gather after the control message), independent of the tail's
    arithmetic. ``slot[p]``: member p's place in torch's rank order (None: the same)."""
    code = fp.code ^ position.code()
    mine = torch.tensor([code], dtype=torch.int64)
    got = torch.empty(len(ranks), dtype=torch.int64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    run(fp.what, label, ranks, lambda: gather(got, mine, group=pg), pg)
    codes = got.tolist()
    others = [ranks[p] for p in range(len(ranks)) if codes[slot[p] if slot else p] != code]
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
        first = diagnose.first_failure()  # a peer that failed first says why (bounded)
        raise _broken(pg, CollectiveError(
            f"{what} over {label} (ranks {list(ranks)}) failed on rank {dist.get_rank()} "
            "after every member agreed to it: a peer died, stalled past the timeout "
            f"({WORLD.timeout_s:g} s) or closed its connection."
            + (f" The first failure of this run: {first}." if first else "")
            + f" Underlying error: {str(err)[:300]}"
        )) from err


def wait_all(works: list[Any]) -> None:
    """Wait for point-to-point requests, each bounded by the timeout (Gloo's own
    send/recv wait has none)."""
    limit = timeout()
    for w in works:
        w.wait(timeout=limit)
