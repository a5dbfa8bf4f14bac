"""Multi-process runtime control: one process per device through torch.distributed.

Launch with ``torchrun --nproc-per-node N program.py`` and call
:func:`initialize` first; the same program then runs unchanged: a
``DeviceMesh.cpu((2, 2), ...)`` built in a 4-process run is a mesh over the 4
processes (device ``CPU(i)`` / ``Accelerator(i)`` is process ``i``'s device),
each process holds only its own shards, and every op runs the native
collective of its step on per-mesh-axis process groups.

Invariants:
- Process ``i`` owns the mesh devices whose id is ``i``.
- Process groups are created once per (mesh, axes) and reused; creation is a
  collective call that every process makes in the same order (SPMD).
- Every collective first agrees with its group on what it is (op, reduce op, group,
  shape, dtype, layout, sequence number; ``runtime/process/agreement.py``) and where the
  program issued it (module, style, op; ``runtime/position.py``), and every wait
  (collectives, point-to-point, barriers, the rendezvous) is bounded by
  ``timeout_s``: a peer that skips a collective, calls another one, stalls, dies or
  is killed makes the others raise :class:`CollectiveError` naming the collective,
  the group and, where known, the absent rank; never a hang, never a Gloo abort.
- A runtime started by :func:`initialize` is shut down at interpreter exit (before
  finalization) when the program did not call :func:`shutdown`: Gloo worker threads
  that drop their last tensor reference during finalization abort the process.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from shardwise.sharding.errors import CollectiveError, ShardingError

if TYPE_CHECKING:
    from shardwise.runtime import Backend

__all__ = [
    "CollectiveError",
    "barrier",
    "initialize",
    "is_initialized",
    "maybe_initialize",
    "process_count",
    "process_index",
    "shutdown",
]

DEFAULT_TIMEOUT_S = 60.0


def _world() -> Backend:
    """The runtime's world services (imported on first use: ``import
    shardwise.distributed`` stays free of torch)."""
    from shardwise.runtime import world_backend

    return world_backend()


def is_initialized() -> bool:
    """True when this process runs the torch.distributed runtime."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def initialize(backend: str | None = None, *, rank: int | None = None,
               world_size: int | None = None, master_addr: str | None = None,
               master_port: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
               init_method: str | None = None, check_collectives: bool | None = None,
               check_replicas: int | None = None) -> None:
    """Start the multi-process runtime.

    Reads the torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, ``LOCAL_RANK``); explicit arguments override it.
    ``backend`` defaults to ``"nccl"`` when an accelerator is present and
    ``"gloo"`` otherwise. ``timeout_s`` bounds every wait: the rendezvous, every
    collective and point-to-point exchange. Every collective checks, in the same
    message or in a tiny one before it, that all processes of its group call the
    same collective (op, reduce op, axes, shape, dtype, layout, count so far) from the
    same program position (the module, its parallel style and the op that issued it);
    a disagreement raises :class:`CollectiveError` on all of them.
    ``check_collectives=True`` (or ``SHARDWISE_CHECK_COLLECTIVES=1``) adds a debug
    check: one more all_gather per collective comparing the full fingerprints.
    ``check_replicas=N`` (or ``SHARDWISE_CHECK_REPLICAS=N``) compares a hash of every
    replicated parameter and plain model input across its replicas every N optimizer
    steps and names the rank whose copy differs
    (:func:`shardwise.parallel.replicas.check_replicas`); off by default (no hook).

    Under ``torchrun --nproc-per-node 4`` (not run as a doctest: it needs the launcher)::

        shardwise.distributed.initialize()
        mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))  # 4 processes as 2x2
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise ShardingError("torch.distributed is not available in this torch build.")
    from shardwise.parallel import replicas

    every = check_replicas if check_replicas is not None else _env_replicas()
    replicas.check_every(every)  # a bad value fails before the rendezvous
    if dist.is_initialized():
        raise ShardingError(
            "shardwise.distributed.initialize() was already called in this process; call "
            "shutdown() first to start again."
        )
    env = os.environ
    rank = int(env.get("RANK", "-1")) if rank is None else rank
    world_size = int(env.get("WORLD_SIZE", "-1")) if world_size is None else world_size
    if init_method is None and (rank < 0 or world_size < 1):
        raise ShardingError(
            f"initialize() needs rank and world_size (got rank={rank}, "
            f"world_size={world_size}): launch with torchrun, or pass rank=, world_size=, "
            "master_addr= and master_port=."
        )
    if master_addr is not None:
        env["MASTER_ADDR"] = master_addr
    if master_port is not None:
        env["MASTER_PORT"] = str(master_port)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if init_method is None and "MASTER_PORT" not in env:
        raise ShardingError("initialize() needs MASTER_PORT (or master_port=) to rendezvous.")
    from shardwise.sharding.devices import accelerator_type

    acc = accelerator_type()
    if backend is None:
        backend = "nccl" if acc == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        local = int(env.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    where = init_method or f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT')}"
    _import_world_capturers()
    start = time.monotonic()
    try:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s), **kwargs,
        )
    except (RuntimeError, ValueError) as err:  # DistStoreError, DistNetworkError
        raise CollectiveError(
            f"initialize(): rank {rank} could not complete the rendezvous of {world_size} "
            f"processes at {where} within {timeout_s:g} s (it gave up after "
            f"{time.monotonic() - start:.1f} s): some process did not start, died, or uses "
            "another address/port or world size. Underlying error: "
            f"{str(err)[:300]}"
        ) from err
    world = _world()   # (the process backend now: its world is up)
    world.begin_world(timeout_s=timeout_s, check_collectives=check_collectives)
    try:  # every process is connected and runs with the same settings
        world.barrier(f"initialize({backend}, timeout_s={timeout_s:g})")
    except CollectiveError:
        world.end_world()
        dist.destroy_process_group()
        raise
    if every:
        replicas.enable(every)
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:  # once per process: shutdown() is safe to call again
        atexit.register(_shutdown_at_exit)
        _EXIT_HOOKED = True


_EXIT_HOOKED = False


def _env_replicas() -> int:
    """``SHARDWISE_CHECK_REPLICAS=N``: check replicas every N optimizer steps (0: off)."""
    raw = os.environ.get("SHARDWISE_CHECK_REPLICAS", "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise ShardingError(
            f"SHARDWISE_CHECK_REPLICAS={raw!r} is not a number of optimizer steps. Set it "
            "to an int (e.g. 100), or 0 / unset to turn the replica check off.") from None


def _import_world_capturers() -> None:
    # These torch modules bind ``group.WORLD`` as a default argument when imported:
    # imported after the rendezvous, they keep the world group alive past shutdown()
    # into interpreter finalization, where Gloo's threads can abort the process.
    # shardwise imports torch._dynamo (which imports them) on first Tensor use anyway.
    import torch._dynamo
    import torch.distributed.nn.functional  # noqa: F401


def _shutdown_at_exit() -> None:
    # atexit runs while the interpreter is whole; a leftover Gloo group torn down in
    # finalization can abort the process ("terminate called without an active exception")
    try:
        shutdown()
    except Exception as err:  # exiting anyway: say why, never replace the exit status
        print(f"shardwise: shutdown at exit failed: {err}", file=sys.stderr)


def barrier(label: str = "barrier") -> None:
    """Wait until every process arrives (bounded by the run's timeout): raises
    :class:`CollectiveError` on all of them if one does not arrive in time or calls
    another collective (a different ``label`` counts as another collective).

    >>> shardwise.distributed.barrier()   # under torchrun  # doctest: +SKIP
    """
    _world().barrier(label)   # (not initialized: a world of one, nothing to wait for)


def maybe_initialize(**kwargs: Any) -> bool:
    """Initialize when launched by torchrun (``RANK`` is set); otherwise leave the
    program on the simulated runtime. Returns True when multi-process.

    This is what lets one program run unchanged under ``python`` and ``torchrun``.
    """
    if is_initialized():
        return True
    if "RANK" not in os.environ:
        return False
    initialize(**kwargs)
    return True


def process_index() -> int:
    """This process's rank (0 when not initialized: the simulated runtime).

    >>> shardwise.distributed.process_index()   # not under torchrun
    0
    """
    return _world().process_index()


def process_count() -> int:
    """How many processes run the program (1 when not initialized).

    >>> shardwise.distributed.process_count()   # not under torchrun
    1
    """
    return _world().process_count()


def shutdown() -> None:
    """Tear down the process groups (safe to call twice). A program that does not
    call it gets it at interpreter exit, registered by :func:`initialize`.

    >>> shardwise.distributed.shutdown()   # not initialized: nothing to tear down
    >>> shardwise.distributed.is_initialized()
    False
    """
    import torch.distributed as dist

    _world().end_world()
    from shardwise.parallel import replicas

    replicas.disable()
    if is_initialized():
        dist.destroy_process_group()
