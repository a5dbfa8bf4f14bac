"""Spawn real Gloo process groups on 127.0.0.1 and run test bodies on every rank.

Bounded: every run has a wall-clock limit; stragglers are killed; a failure on
any rank is reported with its traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import queue as queue_mod
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch.multiprocessing as mp

_REPORT_GRACE_S = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_bounded(cmd: Sequence[str], limit_s: float) -> subprocess.CompletedProcess[str]:
    """``cmd`` (one thread per process) under a hard limit: on timeout its whole process
    group (e.g. torchrun and its ranks) is killed and the calling test fails."""
    import pytest

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{list(cmd)} did not finish within {limit_s} s")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def _worker(rank: int, world: int, port: int, target: str, names: list[str], queue: Any,
            timeout_s: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    import shardwise.distributed as sd

    results: dict[str, str | None] = {}
    try:
        sd.initialize("gloo", rank=rank, world_size=world, master_addr="127.0.0.1",
                      master_port=port, timeout_s=timeout_s)
        module = importlib.import_module(target)
        for name in names:
            try:
                getattr(module, name)(world)
                results[name] = None
            except BaseException:
                results[name] = traceback.format_exc()
    except BaseException:
        results["<setup>"] = traceback.format_exc()
    finally:
        queue.put((rank, results))
        with contextlib.suppress(Exception):
            sd.shutdown()


def run_on_ranks(target: str, names: list[str], world: int, *, limit_s: float = 240.0,
                 timeout_s: float = 30.0, frozen: frozenset[int] = frozenset()
                 ) -> dict[int, dict[str, str | None]]:
    """Run ``target.<name>(world)`` for each name on ``world`` Gloo ranks.

    ``target`` is a module name the ranks import (``bodies.__name__``, e.g.
    ``"tests.helpers.bodies"``): spawned ranks inherit the caller's ``sys.path``.

    Returns ``{rank: {name: None | traceback}}``; a rank that died without
    reporting maps to ``{"<exit>": ...}``; ranks missing after ``limit_s`` are absent.
    ``frozen``: ranks that stop themselves (SIGSTOP) and never report: the run ends when
    the others have reported, and they are killed first.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, target, names, queue, timeout_s),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, str | None]] = {}
    deadline = time.monotonic() + limit_s
    exited: dict[int, float] = {}
    try:
        while len(out) < world - len(frozen) and time.monotonic() < deadline:
            try:
                rank, res = queue.get(timeout=0.2)
                out[rank] = res
            except queue_mod.Empty:
                pass
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in out or p.exitcode is None:
                    continue
                # A rank that died without reporting (killed on purpose, os._exit, a
                # crash): give its report a moment to arrive through the pipe first.
                exited.setdefault(r, now)
                if now - exited[r] > _REPORT_GRACE_S:
                    out[r] = {"<exit>": f"exit code {p.exitcode}"}
    finally:
        for r in frozen:
            procs[r].kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return out


_RESULTS: dict[tuple[str, tuple[str, ...], int], dict[int, dict[str, str | None]]] = {}


def check_body(target: str, names: Sequence[str], world: int, name: str) -> None:
    """Assert that body ``name`` passed on every one of ``world`` Gloo ranks.

    The first call for a (target, names, world) spawns the ranks once and runs
    every body there; later calls read the cached results.
    """
    key = (target, tuple(names), world)
    if key not in _RESULTS:
        _RESULTS[key] = run_on_ranks(target, list(names), world)
    results = _RESULTS[key]
    assert sorted(results) == list(range(world)), f"ranks that reported: {sorted(results)}"
    failures = {r: _failure(res, name) for r, res in results.items()}
    failures = {r: tb for r, tb in failures.items() if tb}
    assert not failures, "\n".join(f"--- rank {r}\n{tb}" for r, tb in failures.items())


def _failure(res: dict[str, str | None], name: str) -> str | None:
    """What went wrong for body ``name`` on one rank, or None if it passed. A rank
    that died without reporting (``"<exit>"``) or never ran the body has failed."""
    for key in ("<setup>", "<exit>"):
        if res.get(key):
            return f"{key}: {res[key]}"
    if name not in res:
        return f"body {name!r} did not run on this rank (it reported {sorted(res)})"
    return res[name]
