"""Point-to-point transfers between two processes: a pytree of torch tensors (a pipeline
stage's activations or gradients) sent to one peer rank, received whole by it, on Gloo
or NCCL.

A transfer is one message on the stream of its key: a fixed header (magic, the sizes
of what follows, a sequence number), every tensor's bytes (16-byte aligned), the key
itself, then the description (JSON: the caller's ``info`` and every tensor's dtype and
shape; left out when it equals the stream's previous transfer's, as in every steady
pipeline step). The tensors come first so that where they lie does not depend on the
key: a receive posted ahead holds its tensors' views before its message arrives
(:func:`_post`). The message's size is what both ends know:
the size of the transfer ``depth`` before it (a stream's first ones: 4 KiB; ``depth``
is 2 on Gloo, where a receiver keeps two receives posted, 1 on NCCL); a payload that
does not fit follows in a second message of its own size (on Gloo on the stream's
overflow tag, clear of the receives posted ahead). So shapes may change from one
transfer to the next (dynamic shapes), and a step whose shapes repeat sends one
message per transfer, as many as torch's stages (whose shapes are fixed).

Invariants:
- A message is a tensor on the stream's device (:func:`message_device`: this
  process's GPU on NCCL, the CPU on Gloo): bytes, or, for a receive posted while the
  stream's description holds tensors of one dtype, that dtype (its tensors are then
  views of it, made before it arrives). Tensor bytes are packed and unpacked with
  device copies (never a host round trip); only the header, the key and the
  description are read on the host.
- A stream (one direction between two ranks, one pair of pipeline stages:
  :func:`stream_tag`) pairs its transfers in the order they were sent, and never with
  another stream's: on Gloo by its tag; where tags do not separate streams (NCCL
  matches a pair's sends and receives in posting order whatever the tag, and opposite
  directions on one communicator can deadlock) every stream runs on its own process
  group (``pg=``; :func:`needs_stream_groups`; the pipeline's are made by
  ``groups.prepare_stage_groups``).
- Both ends size every message, and know the description a transfer may leave out,
  from the stream's history alone (:func:`_next_cap`, ``_Stream.desc``/``parsed``), so
  a healthy stream never pairs buffers of different sizes.
- A receiver posts a stream's receives ahead of their messages, so data flows while
  the stage computes (Gloo moves a message only once its receive is posted). On Gloo
  a receive of message k first posts message k+1's (its size is known: ``depth`` 2),
  then waits: the post (cold Gloo calls) overlaps the wait, and never lies
  between message k's arrival and the compute that waits for it. On NCCL (an enqueue
  on the GPU stream) the next receive is posted as soon as one is taken. A stream
  ends with one such receive posted; the next step's first transfer fills it.
- Sends never block (``isend``: a schedule cannot deadlock on buffering); a sent
  buffer is kept until :func:`flush` waits for its transfer (Gloo completes a send
  only in its wait; the executor flushes once per step). Having handed a message to
  Gloo, the sender yields its core (``sched_yield``): where busy threads outnumber
  cores, the receiver's Gloo thread and its waiting stage are woken onto the
  sender's core and would wait for the sender's next Python; with a core to spare
  the call returns at once.
- Every wait is bounded by the run's timeout, counted from the wait's start, never
  shorter (Gloo closes the connection when a point-to-point wait times out; on NCCL
  the host polls the work: ``p2p_backends.poll``). A peer that died, stalled past the
  timeout or sent another key (another tag, stage or microbatch) raises
  :class:`CollectiveError` naming the peer rank, both keys and the stream; the first
  failure is recorded in the store and quoted by every later error. A stream that
  failed refuses every later transfer (its pairing is lost).
- The received tensors are new (never views of the sender's memory), contiguous, on
  the stream's device, and never require grad; the caller decides.
- A transfer costs its copies and one process-group call on each end, little more:
  the hot path calls the process group itself (what ``dist.isend``/``irecv`` end in)
  and formats no error text unless a transfer fails (a pipeline hop is on the
  critical path of every schedule).
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import json
import marshal
import math
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardwise.runtime import buffers
from shardwise.runtime.process import diagnose
from shardwise.runtime.process.p2p_backends import (
    check_backend,
    message_device,
    needs_stream_groups,
    poll,
)
from shardwise.runtime.process.world import WORLD
from shardwise.runtime.trees import (  # (the transfers' trees: re-exported)
    check_value,
    flatten,
    spec_of,
    spec_text,
    unflatten,
)
from shardwise.sharding.errors import CollectiveError

__all__ = ["check_backend", "check_value", "flatten", "flush", "message_device",
           "needs_stream_groups", "pending", "recv", "recv_parts", "send", "send_parts",
           "spec_of", "spec_text", "stream_tag", "unflatten"]

_MAGIC = 0x5357_5050      # "SWPP"
_HEADER = struct.Struct("<8q")  # magic, key bytes, description bytes (0: the stream's
                          # previous one), payload bytes, sequence number, tensor bytes, 0, 0
_HEAD = _HEADER.size      # 64
_MIN_CAP = 4096           # the smallest message: a stream's first, and small transfers
_ALIGN = 16
_FREE = 8                 # sent CPU messages a stream keeps for its next sends
_TAG_BASE = 1 << 20       # clear of tag 0, which the collectives' exchanges use
_OVERFLOW = 1 << 22       # + a stream's tag: its payloads that follow their header (Gloo)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# A CPU message is written and read by address (ctypes): a pipeline hop runs on caches
# its stage's compute left cold, where each torch call (a slice, a view, a copy) is
# costly, and a hop made a dozen of them.
_memmove = ctypes.memmove
_yield = os.sched_yield
_string_at = ctypes.string_at


@dataclass(frozen=True)
class _Plan:
    """A received description's tensors: each one's dtype, shape, bytes, offset in the
    payload and (contiguous) strides; ``dtype``: the one dtype they all have, if so (a
    message then holds them typed, each one view of it: ``as_strided``)."""

    info: Any
    tensors: tuple[tuple[torch.dtype, tuple[int, ...], int, int, tuple[int, ...]], ...]
    size: int                    # the tensors' bytes in the payload (each 16-aligned)
    dtype: torch.dtype | None


@dataclass
class _Stream:
    """One direction between this process and a peer: the transfers sent or received."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seq: int = 0
    # the next ``depth`` messages' bytes: the same on both ends (the history)
    caps: list[int] = field(init=False)
    cpu: bool = field(init=False)   # (the device is the host: Gloo)
    # the receives posted for the next messages, in order (at most ``depth``)
    # (and the tensors each will hold if its description is the stream's last: _post)
    ahead: list[tuple[Any, torch.Tensor, int, Any]] = field(default_factory=list)
    failed: str = ""
    sends: list[tuple[Any, tuple[torch.Tensor, ...], str]] = field(default_factory=list)
    # CPU messages whose sends completed (flush), with their sizes, for the next sends
    free: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # the last description, which the next transfer may leave out (both ends hold the
    # same one while the stream is healthy): sent, its info's marshal bytes and the
    # tensors' (dtype name, shape); received, parsed
    mark: bytes | None = None
    metas: list[tuple[str, torch.Size]] = field(default_factory=list)
    parsed: _Plan | None = None

    def __post_init__(self) -> None:
        self.cpu = self.device.type == "cpu"
        self.caps = [_MIN_CAP] * (2 if self.cpu else 1)  # depth


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_STREAMS: dict[tuple[int, int, str], _Stream] = {}   # (peer, tag, "send"/"recv")
_WORLD_ID: list[int] = [-1]
_TIMEOUT: list[Any] = [None, None]   # (the run's timeout_s, that timedelta)
_GROUP_RANK: dict[tuple[int, int], int] = {}  # (id(pg), global rank) -> rank in pg
_DEFAULT: list[Any] = [None]  # this world's default group


def _stream(peer: int, tag: int, way: str, pg: Any) -> _Stream:
    if _WORLD_ID[0] != WORLD.generation:  # a new world: forget the old streams
        _STREAMS.clear()
        _GROUP_RANK.clear()
        _DEFAULT[0] = None
        _WORLD_ID[0] = WORLD.generation
    key = (peer, tag, way)
    s = _STREAMS.get(key)
    if s is None:
        s = _STREAMS[key] = _Stream(message_device(pg))
    return s


def stream_tag(src: int, dst: int) -> int:
    """The tag of the stream from pipeline stage ``src`` to stage ``dst`` (Gloo pairs
    by it; on NCCL it keys the stream's own group).

    >>> stream_tag(0, 1) != stream_tag(1, 0)
    True
    """
    return _TAG_BASE + (src << 10) + dst


def _pg(pg: Any) -> Any:
    """``pg``, or the default group (looked up once per world: c10d's lookup checks
    the world each time, on a hop's cold cache)."""
    if pg is not None:
        return pg
    if _DEFAULT[0] is None:
        _DEFAULT[0] = dist.distributed_c10d._get_default_group()
    return _DEFAULT[0]


def _rank_in(pg: Any, peer: int) -> int:
    """``peer``'s rank in ``pg`` (the default group's ranks are the global ones)."""
    if pg is None:
        return peer
    r = _GROUP_RANK.get((id(pg), peer))
    if r is None:
        r = _GROUP_RANK[(id(pg), peer)] = dist.get_group_rank(pg, peer)
    return r


def _fail(stream: _Stream, text: str, err: BaseException | None = None) -> CollectiveError:
    """Record the failure (the stream refuses from now on; the store keeps the first)."""
    first = diagnose.record(text)
    stream.failed = text
    quote = (f" The first failure of this run: {first}." if first and
             not first.startswith(f"rank {dist.get_rank()}: ") else "")
    under = f" Underlying error: {str(err)[:300]}" if err is not None else ""
    return CollectiveError(text + quote + under)


def _refuse(stream: _Stream, what: Callable[[], str]) -> None:
    raise CollectiveError(
        f"{what()} refused: this stream failed earlier and its "
        f"transfers no longer pair up. Stop the program (or shutdown() and initialize() "
        f"again). The earlier error: {stream.failed[:400]}")


def send(tree: Any, peer: int, tag: int, key: str, pg: Any = None) -> None:
    """Send ``tree`` (a pytree of torch tensors, None and scalars) to rank ``peer`` on
    stream ``tag``; ``key`` (e.g. "stage 0 -> stage 1, F3") must equal the receiver's.
    Returns at once; :func:`flush` waits for the transfers (bounded)."""
    leaves, text = flatten(tree)
    items: list[Any] = []
    tensors: list[torch.Tensor] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            items.append(0)
        else:
            check_value(x, "point-to-point send")
            items.append([x])
    send_parts([text, items], tensors, peer, tag, key, pg)


def recv(peer: int, tag: int, key: str, pg: Any = None) -> Any:
    """Receive the next transfer of stream ``tag`` from rank ``peer`` and check that it
    is ``key`` (the sender's key): returns the tree with new tensors. Raises
    :class:`CollectiveError` when the peer sent another key, died, or sent nothing
    within the run's timeout."""
    (text, items), tensors = recv_parts(peer, tag, key, pg)
    it = iter(tensors)
    leaves = [next(it) if item == 0 else item[0] for item in items]
    return unflatten(leaves, text)


def send_parts(info: Any, tensors: Sequence[torch.Tensor], peer: int, tag: int, key: str,
               pg: Any = None) -> None:
    """Send ``tensors`` (plain torch tensors) and ``info`` (any JSON value: what the
    receiver needs to use them) to rank ``peer`` on stream ``tag`` under ``key``;
    :func:`recv_parts` returns both. Returns at once, as :func:`send` does."""
    stream = _stream(peer, tag, "send", pg)
    if stream.failed:
        _refuse(stream, lambda: _sending(key, peer))
    metas = []
    spans = []   # (tensor, its offset in the payload, its bytes)
    at = 0
    for t in tensors:
        if type(t) not in _PLAIN:
            raise CollectiveError(
                f"point-to-point send: a leaf of type {type(t).__name__} is not a plain "
                "torch tensor; send its local block (the pipeline transport does this "
                "for shardwise Tensors).")
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None:
            name = _DTYPE_NAMES[t.dtype] = str(t.dtype)[6:]   # "torch.float32" -> "float32"
        metas.append((name, t.shape))
        n = t.nbytes
        spans.append((t, at, n))
        at += _up(n)
    n_tensors = at
    # the description goes out only when it differs from the stream's last one; marshal
    # (one C call, where JSON's encoder runs Python on a hop's cold cache) tells
    # them apart type-exactly (True from 1, 0.0 from -0.0: the receiver gets these)
    try:
        mark: bytes | None = marshal.dumps(info)
    except ValueError:   # (a value marshal does not take: described every time)
        mark = None
    if mark is not None and mark == stream.mark and metas == stream.metas:
        desc = b""
    else:
        desc = json.dumps([info, metas]).encode()
        stream.mark, stream.metas = mark, metas
    kb = key.encode()
    n_desc = len(desc)
    tail = kb + bytes(_up(len(kb)) - len(kb)) + desc if desc else kb
    at += _up(len(kb)) + _up(n_desc)
    cap = stream.caps[0]
    inline = _HEAD + at <= cap
    stream.seq += 1
    head = _HEADER.pack(_MAGIC, len(kb), n_desc, at, stream.seq, n_tensors, 0, 0)
    # one buffer: the header, the tensors, then the key and description (the padding
    # between them is never read); a payload that does not fit goes second, alone
    dev = stream.device
    free = stream.free
    if free and free[-1][0] == cap:
        message = free.pop()[1]
    else:
        free.clear()   # (another size: the shapes changed)
        message = torch.empty(cap, dtype=torch.uint8, device=dev)
    if inline and stream.cpu and all(map(buffers.by_address, tensors)):
        payload = message
        base = message.data_ptr()
        _memmove(base, head, _HEAD)
        _memmove(base + _HEAD + n_tensors, tail, len(tail))
        for t, off, n in spans:
            if n:  # (an empty tensor's address may be 0)
                _memmove(base + _HEAD + off, t.data_ptr(), n)
    else:
        # from the host: the header, key and description (small); the tensors' bytes
        # are device copies
        payload = (message[_HEAD:_HEAD + at] if inline else
                   torch.empty(at, dtype=torch.uint8, device=dev))
        message[:_HEAD].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        payload[n_tensors:n_tensors + len(tail)].copy_(
            torch.frombuffer(bytearray(tail), dtype=torch.uint8))
        for t, off, n in spans:
            if n:
                payload[off:off + n].copy_(_bytes(t))
    stream.caps = [*stream.caps[1:], _next_cap(at)]
    group = _pg(pg)
    dst = _rank_in(pg, peer)
    try:
        works = (group.send([message], dst, tag),) + (
            () if inline else (group.send([payload], dst, _overflow(stream, tag)),))
    except RuntimeError as err:  # the connection is gone already (the peer died)
        raise _fail(stream, f"{_sending(key, peer)} failed: the peer died or closed its "
                            "connection.",
                    err) from err
    # Gloo's send completes only in its wait (NCCL's when the peer took it): the
    # buffers stay until flush()
    stream.sends.append((works, (message, payload), key))
    if stream.cpu:
        _yield()


def _sending(key: str, peer: int) -> str:
    """A send, as its errors name it (formatted only when one is raised)."""
    return f"Pipeline transfer: rank {dist.get_rank()}'s send of {key} to rank {peer}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as flat bytes (a view where ``t`` is contiguous; a conjugate or
    negative view's bits resolved first, as its values are)."""
    src = t.detach()
    if src.is_conj() or src.is_neg():
        src = src.resolve_conj().resolve_neg()
    return src.reshape(-1).view(torch.uint8)


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _next_cap(payload: int) -> int:
    """The size of a stream's message ``depth`` transfers after one of ``payload`` bytes
    (both ends know it): room for a payload as large, so a step whose shapes repeat
    sends one message per transfer."""
    return max(_MIN_CAP, _HEAD + payload)


def pending() -> int:
    """Transfers sent by this process and not yet waited for (by :func:`flush`)."""
    return sum(len(s.sends) for s in _STREAMS.values())


def flush() -> None:
    """Wait until every transfer this process sent was received (each wait bounded by
    the run's timeout); raises :class:`CollectiveError` naming the peer that did not
    take one."""
    deadline = time.monotonic() + WORLD.timeout_s
    for (peer, _, way), stream in list(_STREAMS.items()):
        if way != "send":
            continue
        for works, bufs, key in stream.sends:
            for w in works:
                _wait(w, deadline, stream, functools.partial(_sending, key, peer))
            if stream.cpu and len(stream.free) < _FREE:
                stream.free.append((bufs[0].numel(), bufs[0]))   # sent: free again
        stream.sends.clear()


def _wait(work: Any, deadline: float | None, stream: _Stream, what: Callable[[], str]
          ) -> None:
    """Wait for ``work`` until ``deadline`` (None: the run's timeout from now, as one
    timedelta made once: building one and passing it by keyword is costly on a hop's
    cold cache)."""
    start = time.monotonic()
    if deadline is None:
        left = WORLD.timeout_s
        if _TIMEOUT[0] != left:
            _TIMEOUT[:] = [left, datetime.timedelta(seconds=left)]
        limit = _TIMEOUT[1]
    else:
        left = max(deadline - start, 0.01)
        limit = datetime.timedelta(seconds=left)
    try:
        if stream.cpu:
            work.wait(limit)
        else:
            poll(work, start + left)
    except RuntimeError as err:
        took = time.monotonic() - start
        timed_out = "timed out" in str(err).lower() or "timeout" in str(err).lower()
        why = (f"timed out after {took:.1f} s (timeout_s={WORLD.timeout_s:g}): the peer "
               "stalled, waits elsewhere, or its program sends or receives something else"
               if timed_out else "failed: the peer died or closed its connection")
        raise _fail(stream, f"{what()} {why}.", err) from err


def recv_parts(peer: int, tag: int, key: str, pg: Any = None
               ) -> tuple[Any, list[torch.Tensor]]:
    """Receive the next transfer of stream ``tag`` from rank ``peer``, check that it is
    ``key``, and return what :func:`send_parts` sent: ``(info, tensors)``, the tensors
    new. Raises as :func:`recv` does."""
    stream = _stream(peer, tag, "recv", pg)

    def what() -> str:
        return f"Pipeline transfer: rank {dist.get_rank()}'s receive of {key} from rank {peer}"
    if stream.failed:
        _refuse(stream, what)
    ahead = stream.ahead
    while len(ahead) < len(stream.caps):  # this message's receive, and on Gloo the next's
        ahead.append(_post(stream, peer, tag, pg, what, stream.caps[len(ahead)]))
    work, message, addr, made = ahead.pop(0)
    _wait(work, None, stream, what)
    # the header, key and description are read on the host (by address on Gloo: a
    # message is never empty, so its address is not 0)
    cpu = addr != 0
    header = _HEADER.unpack(_string_at(addr, _HEAD) if cpu else
                            _as_bytes(message)[:_HEAD].cpu().numpy().tobytes())
    magic, n_key, n_desc, n_all, seq, n_tensors, _, _ = header
    if (magic != _MAGIC or min(n_key, n_desc, n_tensors) < 0 or (n_all | n_tensors) % _ALIGN
            or n_tensors + _up(n_key) + n_desc > n_all
            or (n_desc == 0 and stream.parsed is None)):
        raise _fail(stream, f"{what()}: the peer sent something that "
                    f"is not a transfer (header {list(header)}): its program sends other "
                    "data on this stream.")
    # the payload: bytes ``base..`` of the message, or a message of its own
    payload, base = message, _HEAD
    inline = _HEAD + n_all <= stream.caps[0]
    if not inline:
        work, payload, _, _ = _post(stream, peer, _overflow(stream, tag), pg, what, n_all,
                                    views=False)
        _wait(work, None, stream, what)
        base = 0
    stream.seq += 1
    stream.caps = [*stream.caps[1:], _next_cap(n_all)]
    at = base + n_tensors
    n_body = _up(n_key) + n_desc
    body = (_string_at(payload.data_ptr() + at, n_body) if cpu else
            _as_bytes(payload)[at:at + n_body].cpu().numpy().tobytes())
    if body[:n_key] != key.encode():
        sent_key = body[:n_key].decode(errors="replace")
        raise _fail(stream, (
            f"Pipeline transfer mismatch on rank {dist.get_rank()}: it expected {key} from "
            f"rank {peer} (transfer #{stream.seq} of this stream) but rank {peer} sent "
            f"{sent_key} (its transfer #{seq}). Every stage must send and receive the same "
            "microbatches in the same order (check the schedule table and rank-dependent "
            "code)."))
    if n_desc:
        stream.parsed = _parse(stream, body[_up(n_key):], what)
    plan = stream.parsed
    assert plan is not None
    if plan.size != n_tensors:
        raise _fail(stream, f"{what()}: the peer sent {n_tensors} bytes of tensors where "
                    f"their description gives {plan.size}: its program sends other data "
                    "on this stream.")
    if not ahead:  # NCCL: the next message's receive, now (Gloo's was posted already)
        ahead.append(_post(stream, peer, tag, pg, what, stream.caps[0]))
    if made is not None and made[0] is plan and inline:
        tensors = made[1]   # (the plan the receive was posted with: its views fit)
    else:
        tensors = _views(_as_bytes(payload), base, plan)
    # tensors of one payload share its version counter: copies when there are several
    # (an in-place write to one must not fail another's backward check)
    if len(tensors) > 1:
        tensors = [x.clone() for x in tensors]
    return plan.info, tensors


def _parse(stream: _Stream, desc: bytes, what: Callable[[], str]) -> _Plan:
    """A received description; a :class:`CollectiveError` where this version would not
    write it."""
    try:
        info, metas = json.loads(desc)
        dtypes = [getattr(torch, d) for d, _ in metas]
        plan = [(dt, tuple(shape), math.prod(shape) * dt.itemsize)
                for dt, (_, shape) in zip(dtypes, metas, strict=True)]
        sizes = [d for _, sh, _ in plan for d in sh]
        if not (all(isinstance(dt, torch.dtype) for dt, _, _ in plan)
                and all(type(d) is int and d >= 0 for d in sizes)):
            raise ValueError("a tensor's dtype or shape")
    except (ValueError, TypeError, AttributeError) as err:
        raise _fail(stream, f"{what()}: the peer's description of the transfer is not "
                    f"one this version writes ({str(err)[:120]}): the peer runs another "
                    "program or another version of shardwise on this stream.") from err
    tensors = []
    at = 0
    for dt, shape, nbytes in plan:
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * max(shape[i + 1], 1)
        tensors.append((dt, shape, nbytes, at, tuple(strides)))
        at += _up(nbytes)
    one = {dt for dt, _, _ in plan}
    return _Plan(info, tuple(tensors), at, one.pop() if len(one) == 1 else None)


def _views(payload: torch.Tensor, base: int, plan: _Plan) -> list[torch.Tensor]:
    """The tensors of ``plan`` where they lie in ``payload`` (bytes), from byte ``base``
    on."""
    return [payload[base + at:base + at + n].view(dt).view(shape) if n else
            torch.empty(shape, dtype=dt, device=payload.device)
            for dt, shape, n, at, _ in plan.tensors]


def _as_bytes(message: torch.Tensor) -> torch.Tensor:
    """A message's bytes (a receive posted with a plan's one dtype holds that dtype)."""
    return message if message.dtype is torch.uint8 else message.view(torch.uint8)


def _overflow(stream: _Stream, tag: int) -> int:
    """The tag of a payload that follows its header alone: on Gloo the stream's
    overflow tag (the receive posted ahead for the next message must not take it);
    on NCCL the stream's own group, where nothing else is posted meanwhile."""
    return tag + _OVERFLOW if stream.cpu else tag


def _post(stream: _Stream, peer: int, tag: int, pg: Any, what: Callable[[], str],
          nbytes: int, *, views: bool = True) -> tuple[Any, torch.Tensor, int, Any]:
    """Post the receive of the stream's next message of ``nbytes`` bytes (the cap its
    history gives, or a payload that follows its header alone), with the message's
    address on the host (0: on a GPU) and the
    tensors the message holds if its description is the stream's last one (``(plan,
    views)``; None where they would not fit): made now, while the transfer is in
    flight, not after it arrived, when the stage waits for them (slicing and viewing
    are costly on a hop's cold cache). Where the plan's tensors share one dtype the
    message has it, so each tensor is one ``as_strided`` view (offsets and sizes are
    multiples of 16 bytes)."""
    plan = stream.parsed if views else None
    if plan is not None and _HEAD + plan.size > nbytes:
        plan = None   # (this message holds another size: its tensors are made on arrival)
    one = None if plan is None else plan.dtype
    if one is None:
        message = torch.empty(nbytes, dtype=torch.uint8, device=stream.device)
    else:
        message = torch.empty(nbytes // one.itemsize, dtype=one, device=stream.device)
    try:
        work = _pg(pg).recv([message], _rank_in(pg, peer), tag)
    except RuntimeError as err:
        raise _fail(stream, f"{what()} failed: the peer died or closed its connection.",
                    err) from err
    made = None
    if plan is not None:
        if one is None:
            made = (plan, _views(message, _HEAD, plan))
        else:
            k = one.itemsize
            made = (plan, [message.as_strided(shape, strides, (_HEAD + at) // k) if n else
                           torch.empty(shape, dtype=dt, device=stream.device)
                           for dt, shape, n, at, strides in plan.tensors])
    return work, message, message.data_ptr() if message.is_cpu else 0, made
