"""Two torchrun launches on 127.0.0.1 (``--nnodes 2 --nproc-per-node 2``, c10d
rendezvous) form one 2x2 mesh (node x local): the demo trains with parity, and a
fault scenario raises CollectiveError on the processes that must see it.
Every launch has a hard wall-clock limit; stragglers are killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from tests.helpers import HELPERS_DIR
from tests.helpers.harness import free_port

LIMIT_S = 240


def _two_nodes(*program: str) -> list[tuple[int, str, str]]:
    torchrun = Path(sys.executable).with_name("torchrun")
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for node in (0, 1):
        cmd = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend",
               "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
               "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'},join_timeout=60",
               "--max-restarts", "0", *program]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=LIMIT_S)
            out.append((p.returncode, so, se))
    except subprocess.TimeoutExpired:
        seen = []
        for p in procs:  # what each launch printed (workers dump their stacks when stuck)
            if p.poll() is None:  # the launcher and its workers
                os.killpg(p.pid, signal.SIGKILL)
            so, se = p.communicate()
            seen.append(f"--- exit {p.returncode}\n{so[-3000:]}\n{se[-6000:]}")
        raise AssertionError(f"two-node launch still running after {LIMIT_S} s:\n"
                             + "\n".join(seen)) from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return out


def test_demo_on_two_nodes() -> None:
    res = _two_nodes("-m", "shardwise.cli.demo", "--steps", "20")
    for code, _, se in res:
        assert code == 0, se[-3000:]
    text = "".join(so for _, so, _ in res)
    assert "parity OK" in text, text[-2000:]
    assert "dp=2, tp=2" in text, text[-2000:]


def test_fault_scenario_on_two_nodes() -> None:
    res = _two_nodes(str(HELPERS_DIR / "multinode_faults.py"))
    for code, so, se in res:
        assert code == 0, (so, se[-3000:])
    text = "".join(so for _, so, _ in res)
    for r in range(4):
        assert f"OK rank {r}: 2x2 mesh over 2 nodes" in text, text
        assert f"OK rank {r}: mismatch raised" in text, text
    assert "OK rank 1: absent peer on the other node named" in text, text
    assert text.count("its own gather unaffected") == 2, text
    for r in range(4):
        assert f"OK rank {r}: runtime shut down before exit (True)" in text, text
