"""A world of one process (NCCL on a GPU, Gloo on the CPU): the process runtime's
collectives, its agreement check and its point-to-point transfers, beside torch.

What one process can and cannot show:

- ``collectives``: every communication op of the API on a one-device mesh of this
  process (shard, all_gather, all_to_all, all_reduce and reduce_scatter for every
  reduce op, distributed_broadcast, ppermute, a backward) against torch's values, and
  torch's own collectives on the world group (all_reduce, all_gather, reduce_scatter,
  all_to_all_single, broadcast) against the input. A group of
  one member skips the data exchange, so the row counts what reached the backend.
- ``agreement``: the control message of the default-on agreement check, over the
  backend: a barrier (header only) and a small all_reduce folded into the message,
  each checked.
- ``p2p``: the pipeline transport's messages (header, tensors, key, description, a
  payload too large for its message, a receive posted ahead) sent to this process
  itself. Neither backend pairs a lone send with a receive of the same process: NCCL
  runs a send to self only grouped with its receive, so :class:`SelfPeer` launches each
  pair as torch's ``batch_isend_irecv``; Gloo has no connection to itself, so there it
  copies on the host.

NCCL behaviours that need two GPUs (stream groups, transfers between stages, timeouts)
are listed in docs/DESIGN.md with the commands that check them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SelfPeer", "agreement", "collectives", "p2p_loopback", "start"]


def start(device: str, timeout_s: float) -> str:
    """Start a world of this one process (NCCL for ``cuda``, else Gloo); its backend."""
    import shardwise.distributed as sd
    from benchmarks.common import free_port

    backend = "nccl" if device == "cuda" else "gloo"
    sd.initialize(backend, rank=0, world_size=1, master_addr="127.0.0.1",
                  master_port=free_port(), timeout_s=timeout_s)
    return backend


class _Calls:
    """Counts what reaches the backend: agreement control messages and data exchanges."""

    def __init__(self) -> None:
        from shardwise.runtime.process import agreement as process_agreement

        self.control = self.data = 0
        self._agree, self._run = process_agreement.agree, process_agreement.run

        def agree(*args: Any, **kwargs: Any) -> Any:
            self.control += 1
            return self._agree(*args, **kwargs)

        def run(*args: Any, **kwargs: Any) -> Any:
            self.data += 1
            return self._run(*args, **kwargs)

        process_agreement.agree, process_agreement.run = agree, run

    def close(self) -> None:
        from shardwise.runtime.process import agreement as process_agreement

        process_agreement.agree, process_agreement.run = self._agree, self._run


def _same(got: torch.Tensor, want: torch.Tensor, what: str, exact: bool = True) -> None:
    ok = (got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
          and (torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-5,
                                                                   atol=1e-6)))
    if not ok:
        raise AssertionError(f"{what}: got {got.dtype} {tuple(got.shape)} on {got.device}, "
                             f"want {want.dtype} {tuple(want.shape)} on {want.device}"
                             + ("" if got.shape != want.shape else
                                f"; max difference {(got - want).abs().max().item():.3g}"))


def collectives(device: str) -> tuple[bool, str, dict[str, Any]]:
    """The API's communication ops on this process's one-device mesh, and torch's own
    collectives on the world group (see the module doc)."""
    import shardwise as sw
    from shardwise import Partial, PlacementMapping, ReduceOp, Replicated, Sharded

    dev = _device(device)
    mesh = sw.init_device_mesh(device, (1,), ("x",))
    x = (torch.arange(24.0).reshape(6, 4) / 3).to(dev)

    def pm(p: Any) -> PlacementMapping:
        return PlacementMapping(mesh, (p,))

    cases: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
        "shard": lambda: (sw.shard(x, mesh, ["x", None]).to_torch(), x),
        "all_gather": lambda: (sw.all_gather(sw.tensor(x, sharding=pm(Sharded(0)))).to_torch(),
                               x),
        "all_to_all": lambda: (sw.all_to_all(sw.tensor(x, sharding=pm(Sharded(0))), 1, 0)
                               .to_torch(), x),
        "reduce_scatter": lambda: (sw.reduce_scatter(sw.tensor(x, sharding=pm(Partial())), 0)
                                   .to_torch(), x),
        "distributed_broadcast": lambda: (sw.distributed_broadcast(x, mesh).to_torch(), x),
        "ppermute": lambda: (sw.ppermute(sw.tensor(x, sharding=pm(Sharded(0))), [(0, 0)])
                             .to_torch(), x),
        "backward of all_gather": lambda: _grad_of_gather(x, pm(Sharded(0))),
    }
    def reduced(op: ReduceOp) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        return lambda: (sw.all_reduce(sw.tensor(x, sharding=pm(Partial(op)))).to_torch(), x)

    for op in ReduceOp:
        cases[f"all_reduce {op.value}"] = reduced(op)
    cases["to_torch of Replicated"] = lambda: (sw.tensor(x, sharding=pm(Replicated()))
                                               .to_torch(), x)
    calls = _Calls()
    try:
        failed = _run_cases(cases)
    finally:
        calls.close()
    torch_failed = _run_cases(_torch_cases(x))
    data = {"api": sorted(cases), "api_failed": failed, "torch": sorted(_torch_cases(x)),
            "torch_failed": torch_failed, "control_messages": calls.control,
            "data_exchanges": calls.data}
    bad = {**failed, **{f"torch {k}": v for k, v in torch_failed.items()}}
    if bad:
        name, why = next(iter(bad.items()))
        return False, f"{len(bad)} failed, first {name}: {why}", data
    return True, (f"{len(cases)} API ops and {len(_torch_cases(x))} of torch's collectives "
                  f"equal torch's values; the API's reached the backend with {calls.control} "
                  f"control message(s) and {calls.data} data exchange(s) (a group of one "
                  "skips the data)"), data


def _grad_of_gather(x: torch.Tensor, layout: Any) -> tuple[torch.Tensor, torch.Tensor]:
    import shardwise as sw

    w = sw.tensor(x, sharding=layout, requires_grad=True)
    (sw.all_gather(w).to_torch() * 2).sum().backward()
    assert w.grad is not None
    return w.grad.to_torch(), torch.full_like(x, 2.0)


def _torch_cases(x: torch.Tensor) -> dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    # (torch 2.13 renamed two of them; older ones have only the old names)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def all_reduce() -> tuple[torch.Tensor, torch.Tensor]:
        y = x.clone()
        dist.all_reduce(y)
        return y, x

    def all_gather() -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.empty_like(x)
        gather(y, x)
        return y, x

    def reduce_scatter() -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.empty_like(x)
        scatter(y, x.clone())
        return y, x

    def all_to_all() -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x.clone())
        return y, x

    def broadcast() -> tuple[torch.Tensor, torch.Tensor]:
        y = x.clone()
        dist.broadcast(y, 0)
        return y, x

    return {"all_reduce": all_reduce, "all_gather": all_gather,
            "reduce_scatter": reduce_scatter, "all_to_all_single": all_to_all,
            "broadcast": broadcast}


def _run_cases(cases: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]
               ) -> dict[str, str]:
    """Each case's (got, want) compared; the failures' first lines by name."""
    failed = {}
    for name, case in cases.items():
        try:
            got, want = case()
            _same(got, want, name, exact=not name.startswith("all_reduce avg"))
        except Exception as err:  # every case reports, the others still run
            failed[name] = first_line(err)
    return failed


def agreement(device: str) -> tuple[bool, str, dict[str, Any]]:
    """The agreement check's control message over the backend: a barrier (header only),
    then a small all_reduce folded into the message."""
    import shardwise.distributed as sd
    from shardwise.runtime.process import agreement as process_agreement
    from shardwise.runtime.process import collectives as process_collectives
    from shardwise.sharding.placements import ReduceOp

    world = process_collectives.world_group()
    sd.barrier("gpu check")
    x = (torch.arange(12.0) / 7).to(_device(device))
    fp = process_agreement.fingerprint("all_reduce", ReduceOp.SUM, world.label, tuple(x.shape),
                                       x.dtype, "gpu check", (), 0)
    out = process_agreement.agree(world.pg, world.ranks, world.label, fp, x)
    assert out is not None
    _same(out.to(x.device), x, "the folded all_reduce")
    backend = dist.get_backend()
    return True, (f"a barrier and a folded all_reduce agreed over {backend} (on "
                  f"{x.device})"), {"backend": backend}


class SelfPeer:
    """This process's world group as its own peer, for the pipeline transport: each
    receive is paired (per tag, in posting order) with the send for it; the pair runs as
    ``batch_isend_irecv`` of one send to self and one receive from self (NCCL runs a
    self send/receive only as one group), or as a host copy where the backend has no
    connection to itself (Gloo)."""

    def __init__(self, grouped: bool) -> None:
        self.grouped = grouped
        self.sends: dict[int, list[tuple[torch.Tensor, _Pair]]] = {}
        self.recvs: dict[int, list[tuple[torch.Tensor, _Pair]]] = {}
        self.pairs = 0

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Pair:
        return self._add(self.sends, tensors[0], tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Pair:
        return self._add(self.recvs, tensors[0], tag)

    def _add(self, side: dict[int, list[tuple[torch.Tensor, _Pair]]], t: torch.Tensor,
             tag: int) -> _Pair:
        pair = _Pair()
        side.setdefault(tag, []).append((t, pair))
        sends, recvs = self.sends.get(tag, []), self.recvs.get(tag, [])
        while sends and recvs:
            (sent, a), (into, b) = sends.pop(0), recvs.pop(0)
            if sent.nbytes != into.nbytes:
                raise RuntimeError(f"a send of {sent.nbytes} bytes paired with a receive of "
                                   f"{into.nbytes} on tag {tag}")
            if self.grouped:
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, 0, tag=tag),
                                                dist.P2POp(dist.irecv, into, 0, tag=tag)])
                a.works = b.works = works
            else:
                into.view(torch.uint8).copy_(sent.view(torch.uint8))
                a.works = b.works = []
            self.pairs += 1
        return pair


class _Pair:
    """The work of one side of a :class:`SelfPeer` pair (done once both sides exist)."""

    def __init__(self) -> None:
        self.works: list[Any] | None = None

    def is_completed(self) -> bool:
        return self.works is not None and all(w.is_completed() for w in self.works)

    def wait(self, timeout: Any = None) -> bool:
        if self.works is None:
            raise RuntimeError("timed out: nothing was paired with this transfer")
        for w in self.works:
            w.wait()
        return True


def p2p_loopback(device: str) -> tuple[bool, str, dict[str, Any]]:
    """Transfers through the pipeline transport to this process itself (see
    :class:`SelfPeer`): shapes and dtypes that change, one payload too large for its
    message, a description left out when it repeats; then ``flush``."""
    from shardwise.runtime.process import p2p

    backend = dist.get_backend()
    peer = SelfPeer(grouped=backend == "nccl")
    real = p2p._pg

    def itself(pg: Any) -> Any:   # the transport's default group: this process itself
        return peer

    p2p._pg = itself
    try:
        dev = p2p.message_device()
        a = torch.arange(6.0, device=dev).reshape(2, 3)
        big = torch.arange(3000, dtype=torch.int32, device=dev)   # more than a message holds
        mixed = [torch.arange(4.0, dtype=torch.float64, device=dev), a.t() * 1]
        sent = [[a], [a + 1], [big, a], mixed, [a * 2]]
        for i, tensors in enumerate(sent):
            p2p.send_parts({"n": i}, tensors, 0, 7, f"F{i}")
            info, got = p2p.recv_parts(0, 7, f"F{i}")
            assert info == {"n": i}, info
            for g, want in zip(got, tensors, strict=True):
                _same(g, want.contiguous(), f"transfer F{i}")
        p2p.flush()
    finally:
        p2p._pg = real
    how = ("each pair one NCCL batch_isend_irecv to itself" if peer.grouped else
           "host copies: Gloo has no connection to its own rank")
    return True, (f"{len(sent)} transfers ({peer.pairs} messages) through the transport on "
                  f"{dev}, {how}"), {"messages": peer.pairs, "backend": backend}


def _device(device: str) -> torch.device:
    return torch.device("cpu") if device == "cpu" else torch.device(
        device, torch.cuda.current_device())


def first_line(err: BaseException) -> str:
    """``Type: the message's first line`` (at most 200 characters)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__

