"""Point-to-point transfers between two processes: a pytree of torch tensors (a pipeline
stage's activations or gradients) sent to one peer rank, received whole by it, on Gloo
or NCCL.

A transfer is one message on the stream of its key: a fixed header (magic, the
fingerprint of the key, the sizes of what follows, a sequence number), the key itself,
the description (JSON: the caller's ``info`` and every tensor's dtype and shape; left
out when it equals the stream's previous transfer's, as in every steady pipeline step),
then every tensor's bytes, 16-byte aligned. The message's size is what both ends know:
the size of the transfer ``depth`` before it (a stream's first ones: 4 KiB; ``depth``
is 2 on Gloo, where a receiver keeps two receives posted, 1 on NCCL); a payload that
does not fit follows in a second message of its own size (on Gloo on the stream's
overflow tag, clear of the receives posted ahead). So shapes may change from one
transfer to the next (dynamic shapes), and a step whose shapes repeat sends one
message per transfer, as many as torch's stages (whose shapes are fixed).

Invariants:
- A message is a uint8 tensor on the stream's device (:func:`message_device`: this
  process's GPU on NCCL, the CPU on Gloo). Tensor bytes are packed and unpacked with
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
  then waits: the post (~0.1 ms on a cold cache) overlaps the wait, and never lies
  between message k's arrival and the compute that waits for it. On NCCL (an enqueue
  on the GPU stream) the next receive is posted as soon as one is taken. A stream
  ends with one such receive posted; the next step's first transfer fills it.
- Sends never block (``isend``: a schedule cannot deadlock on buffering); a sent
  buffer is kept until :func:`flush` waits for its transfer (Gloo completes a send
  only in its wait; the executor flushes once per step).
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
import math
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from shardwise.runtime import buffers
from shardwise.runtime.process import diagnose
from shardwise.runtime.process.p2p_backends import (
    check_backend,
    message_device,
    needs_stream_groups,
    poll,
)
from shardwise.runtime.process.world import WORLD
from shardwise.sharding.errors import CollectiveError

__all__ = ["check_backend", "check_value", "flush", "message_device", "needs_stream_groups",
           "pending", "recv", "recv_parts", "send", "send_parts", "spec_of", "spec_text",
           "stream_tag"]

_MAGIC = 0x5357_5050      # "SWPP"
_HEADER = struct.Struct("<8q")  # magic, key code, key bytes, description bytes (0: the
                          # stream's previous one), payload bytes, sequence number, 0, 0
_HEAD = _HEADER.size      # 64
_MIN_CAP = 4096           # the smallest message: a stream's first, and small transfers
_ALIGN = 16
_FREE = 8                 # sent CPU messages a stream keeps for its next sends
_TAG_BASE = 1 << 20       # clear of tag 0, which the collectives' exchanges use
_OVERFLOW = 1 << 22       # + a stream's tag: its payloads that follow their header (Gloo)
_LEAF_VALUES = (type(None), bool, int, float, str)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# A CPU message is written and read by address (ctypes): a pipeline hop runs on caches
# its stage's compute left cold, where each torch call (a slice, a view, a copy) costs
# ~10-20 us; the hop's dozen of them were a third of its time above torch's.
_memmove = ctypes.memmove
_string_at = ctypes.string_at


@dataclass
class _Stream:
    """One direction between this process and a peer: the transfers sent or received."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seq: int = 0
    # the next ``depth`` messages' bytes: the same on both ends (the history)
    caps: list[int] = field(init=False)
    # the receives posted for the next messages, in order (at most ``depth``)
    ahead: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    failed: str = ""
    sends: list[tuple[Any, tuple[torch.Tensor, ...], str]] = field(default_factory=list)
    # CPU messages whose sends completed (flush), for the next sends of their size
    free: list[torch.Tensor] = field(default_factory=list)
    # the last description (sent: its bytes; received: parsed), which the next transfer
    # may leave out: both ends hold the same one while the stream is healthy
    desc: bytes = b""
    parsed: tuple[Any, list[tuple[torch.dtype, tuple[int, ...], int]]] | None = None

    def __post_init__(self) -> None:
        self.caps = [_MIN_CAP] * (2 if self.device.type == "cpu" else 1)  # depth


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_STREAMS: dict[tuple[int, int, str], _Stream] = {}   # (peer, tag, "send"/"recv")
_WORLD_ID: list[int] = [-1]
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


def _code(key: str) -> int:
    return zlib.crc32(key.encode()) & 0x7FFF_FFFF


_SPECS: dict[Any, str] = {}   # TreeSpec -> its JSON (a step repeats a few structures)


def spec_text(spec: Any) -> str:
    """``treespec_dumps(spec)``, cached (tens of us per call; a hash is ~3 us)."""
    text = _SPECS.get(spec)
    if text is None:
        if len(_SPECS) > 256:
            _SPECS.clear()
        text = _SPECS[spec] = pytree.treespec_dumps(spec)
    return text


@functools.lru_cache(maxsize=256)
def spec_of(text: str) -> Any:
    """The TreeSpec of :func:`spec_text`'s text (cached)."""
    return pytree.treespec_loads(text)


def _pg(pg: Any) -> Any:
    """``pg``, or the default group (looked up once per world: c10d's lookup checks
    the world each time, ~10 us on a hop's cold cache)."""
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


def check_value(x: Any, who: str) -> None:
    """Refuse a leaf that is neither a tensor nor a value a transfer carries as it is
    (None, bool, int, float, str), naming ``who`` sends it.

    >>> check_value(2.5, "send")
    >>> check_value(object(), "send")
    Traceback (most recent call last):
    ...
    shardwise.sharding.errors.CollectiveError: send: cannot send a leaf of type object ...
    """
    if not isinstance(x, _LEAF_VALUES):
        raise CollectiveError(
            f"{who}: cannot send a leaf of type {type(x).__name__} ({x!r:.60}); a value "
            "must be a tree (tuple, list, dict) of tensors, None, bool, int, float or str.")


def send(tree: Any, peer: int, tag: int, key: str, pg: Any = None) -> None:
    """Send ``tree`` (a pytree of torch tensors, None and scalars) to rank ``peer`` on
    stream ``tag``; ``key`` (e.g. "stage 0 -> stage 1, F3") must equal the receiver's.
    Returns at once; :func:`flush` waits for the transfers (bounded)."""
    leaves, spec = pytree.tree_flatten(tree)
    items: list[Any] = []
    tensors: list[torch.Tensor] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            items.append(0)
        else:
            check_value(x, "point-to-point send")
            items.append([x])
    send_parts([spec_text(spec), items], tensors, peer, tag, key, pg)


def recv(peer: int, tag: int, key: str, pg: Any = None) -> Any:
    """Receive the next transfer of stream ``tag`` from rank ``peer`` and check that it
    is ``key`` (the sender's key): returns the tree with new tensors. Raises
    :class:`CollectiveError` when the peer sent another key, died, or sent nothing
    within the run's timeout."""
    (text, items), tensors = recv_parts(peer, tag, key, pg)
    it = iter(tensors)
    leaves = [next(it) if item == 0 else item[0] for item in items]
    return pytree.tree_unflatten(leaves, spec_of(text))


def send_parts(info: Any, tensors: Sequence[torch.Tensor], peer: int, tag: int, key: str,
               pg: Any = None) -> None:
    """Send ``tensors`` (plain torch tensors) and ``info`` (any JSON value: what the
    receiver needs to use them) to rank ``peer`` on stream ``tag`` under ``key``;
    :func:`recv_parts` returns both. Returns at once, as :func:`send` does."""
    stream = _stream(peer, tag, "send", pg)
    if stream.failed:
        _refuse(stream, lambda: _sending(key, peer))
    metas = []
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
    desc = json.dumps([info, metas]).encode()
    kb = key.encode()
    same = desc == stream.desc
    n_desc = 0 if same else len(desc)
    at = _up(len(kb)) + _up(n_desc)
    spans = []   # (tensor, its offset in the payload, its bytes)
    for t in tensors:
        n = t.numel() * t.element_size()
        spans.append((t, at, n))
        at += _up(n)
    cap = stream.caps[0]
    inline = _HEAD + at <= cap
    stream.seq += 1
    prefix = _HEADER.pack(_MAGIC, _code(key), len(kb), n_desc, at, stream.seq, 0, 0) + kb
    if not same:
        prefix += bytes(_up(len(kb)) - len(kb)) + desc
    # one buffer: the header, key and description, then the tensors (the padding
    # between them is never read); a payload that does not fit goes second, alone
    # (from the host: small; the tensors' bytes are device copies)
    dev = stream.device
    free = stream.free
    if free and free[-1].numel() == cap:
        message = free.pop()
    else:
        free.clear()   # (another size: the shapes changed)
        message = torch.empty(cap, dtype=torch.uint8, device=dev)
    if inline and dev.type == "cpu" and all(map(buffers.by_address, tensors)):
        payload = message
        base = message.data_ptr()
        _memmove(base, prefix, len(prefix))
        for t, off, n in spans:
            if n:  # (an empty tensor's address may be 0)
                _memmove(base + _HEAD + off, t.data_ptr(), n)
    else:
        head = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
        if inline:
            payload = message[_HEAD:_HEAD + at]
            message[:len(prefix)].copy_(head)
        else:
            payload = torch.empty(at, dtype=torch.uint8, device=dev)
            message[:_HEAD].copy_(head[:_HEAD])
            payload[:len(prefix) - _HEAD].copy_(head[_HEAD:])
        for t, off, n in spans:
            if n:
                payload[off:off + n].copy_(_bytes(t))
    stream.caps = [*stream.caps[1:], _next_cap(at)]
    stream.desc = desc
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
            if stream.device.type == "cpu" and len(stream.free) < _FREE:
                stream.free.append(bufs[0])   # sent: its memory is free for the next
        stream.sends.clear()


def _wait(work: Any, deadline: float, stream: _Stream, what: Callable[[], str]) -> None:
    left = max(deadline - time.monotonic(), 0.01)
    start = time.monotonic()
    try:
        if stream.device.type == "cpu":
            work.wait(timeout=datetime.timedelta(seconds=left))
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
    deadline = time.monotonic() + WORLD.timeout_s
    ahead = stream.ahead
    while len(ahead) < len(stream.caps):  # this message's receive, and on Gloo the next's
        ahead.append(_post(stream, peer, tag, pg, what, stream.caps[len(ahead)]))
    work, message = ahead.pop(0)
    _wait(work, deadline, stream, what)
    # the header, key and description are read on the host (.cpu(): a no-op on Gloo)
    cpu = message.device.type == "cpu"
    header = _HEADER.unpack(_string_at(message.data_ptr(), _HEAD) if cpu else
                            message[:_HEAD].cpu().numpy().tobytes())
    magic, code, n_key, n_desc, n_all, seq, _, _ = header
    if (magic != _MAGIC or min(n_key, n_desc) < 0 or _up(n_key) + n_desc > n_all
            or (n_desc == 0 and stream.parsed is None)):
        raise _fail(stream, f"{what()}: the peer sent something that "
                    f"is not a transfer (header {list(header)}): its program sends other "
                    "data on this stream.")
    # the payload: bytes ``base..`` of the message, or a message of its own
    payload, base = message, _HEAD
    if _HEAD + n_all > stream.caps[0]:
        work, payload = _post(stream, peer, _overflow(stream, tag), pg, what, n_all)
        _wait(work, deadline, stream, what)
        base = 0
    stream.seq += 1
    stream.caps = [*stream.caps[1:], _next_cap(n_all)]
    n_body = _up(n_key) + n_desc
    body = (_string_at(payload.data_ptr() + base, n_body) if cpu else
            payload[base:base + n_body].cpu().numpy().tobytes())
    sent_key = body[:n_key].decode(errors="replace")
    if code != _code(key) or sent_key != key:
        raise _fail(stream, (
            f"Pipeline transfer mismatch on rank {dist.get_rank()}: it expected {key} from "
            f"rank {peer} (transfer #{stream.seq} of this stream) but rank {peer} sent "
            f"{sent_key} (its transfer #{seq}). Every stage must send and receive the same "
            "microbatches in the same order (check the schedule table and rank-dependent "
            "code)."))
    at = _up(n_key)
    if n_desc:
        try:
            info, metas = json.loads(body[at:at + n_desc])
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
        stream.parsed = (info, plan)
        at += _up(n_desc)
    assert stream.parsed is not None
    info, plan = stream.parsed
    if not ahead:  # NCCL: the next message's receive, now (Gloo's was posted already)
        ahead.append(_post(stream, peer, tag, pg, what, stream.caps[0]))
    # tensors of one payload share its version counter: copies when there are several
    # (an in-place write to one must not fail another's backward check)
    several = len(plan) > 1
    at += base
    tensors = []
    for dtype, shape, nbytes in plan:
        if nbytes:
            x = payload[at:at + nbytes].view(dtype).view(shape)
            tensors.append(x.clone() if several else x)
        else:
            tensors.append(torch.empty(shape, dtype=dtype, device=payload.device))
        at += _up(nbytes)
    return info, tensors


def _overflow(stream: _Stream, tag: int) -> int:
    """The tag of a payload that follows its header alone: on Gloo the stream's
    overflow tag (the receive posted ahead for the next message must not take it);
    on NCCL the stream's own group, where nothing else is posted meanwhile."""
    return tag + _OVERFLOW if stream.device.type == "cpu" else tag


def _post(stream: _Stream, peer: int, tag: int, pg: Any, what: Callable[[], str],
          nbytes: int) -> tuple[Any, torch.Tensor]:
    """Post the receive of the stream's next message of ``nbytes`` bytes (the cap its
    history gives, or a payload that follows its header alone)."""
    message = torch.empty(nbytes, dtype=torch.uint8, device=stream.device)
    try:
        return _pg(pg).recv([message], _rank_in(pg, peer), tag), message
    except RuntimeError as err:
        raise _fail(stream, f"{what()} failed: the peer died or closed its connection.",
                    err) from err
