"""Bodies for the replica check on Gloo processes (issue 24, item 6): a rank whose
replicated parameter (or plain input) differs is named on every rank at the right
step; with the check off nothing is installed."""

from __future__ import annotations

import json
import os
import time

import torch

from shardwise import DeviceMesh
from shardwise.distributed import CollectiveError, process_index
from shardwise.parallel import parallelize_module, replicas
from tests.helpers.position_faults import Net, plan


def _model(n: int) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net(4 * n)
    parallelize_module(model, DeviceMesh.cpu((n,), ("tp",)), plan(False))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model: Net, opt: torch.optim.Optimizer, steps: int, x: torch.Tensor,
           before_step: object = None) -> int:
    """Train; returns the step (1-based) whose optimizer.step() raised (0: none)."""
    for step in range(1, steps + 1):
        if callable(before_step):
            before_step(step)
        opt.zero_grad()
        model(x).sum().backward()
        start = time.monotonic()
        try:
            opt.step()
        except CollectiveError as err:
            _ERRORS.append(str(err))
            _report(error=str(err), seconds=time.monotonic() - start, step=step)
            return step
    return 0


def _report(**fields: object) -> None:
    """Into ``SHARDWISE_TEST_REPORT`` (a folder), when set: the fault table's row."""
    folder = os.environ.get("SHARDWISE_TEST_REPORT")
    if folder:
        name = f"replicas.{time.time_ns()}.{process_index()}.json"
        with open(os.path.join(folder, name), "w") as f:
            json.dump(fields, f)


_ERRORS: list[str] = []


def body_param_differs(n: int) -> None:
    """SHARDWISE_CHECK_REPLICAS=2 (the launcher's environment): rank 1 nudges its copy
    of layers.0.mlp.fc2.bias (Replicated) after step 2, so the check at step 4 names
    it, on every rank; step 2's check passed."""
    assert replicas.ENABLED is not None and replicas.ENABLED.every == 2
    model, opt = _model(n)
    bias = model.layers[0].mlp.fc2.bias

    def nudge(step: int) -> None:
        if step == 3 and process_index() == 1:
            with torch.no_grad():
                bias.shards[1].add_(1e-3)  # this rank's copy alone

    torch.manual_seed(1)
    failed = _train(model, opt, 6, torch.randn(4, 4 * n), nudge)
    assert failed == 4, (failed, _ERRORS)
    text = _ERRORS[-1]
    others = " and ".join(str(r) for r in range(n) if r != 1)
    assert text.startswith("Replica check at step 4: layers.0.mlp.fc2.bias (Replicated over "
                           "mesh axes ['tp']"), text
    assert f"rank 1's copy differs from the majority (ranks {others})" in text, text


def body_input_differs(n: int) -> None:
    """Rank 2 feeds its own batch (same shape): the check at step 1 names rank 2 and the
    input that layers.0.mlp.fc1 placed."""
    model, opt = _model(n)
    torch.manual_seed(1 if process_index() != 2 else 2)
    failed = _train(model, opt, 2, torch.randn(4, 4 * n))
    assert failed == 1, (failed, _ERRORS)
    text = _ERRORS[-1]
    assert "Replica check at step 1: input 0 of layers.0.mlp.fc1 (a plain tensor" in text, text
    assert "rank 2's copy differs from the majority (ranks 0 and 1)" in text, text
    assert "fc2.bias" not in text, text  # step 1's parameters were still equal


def body_two_ranks_name_both(n: int) -> None:
    """With two ranks there is no majority: both are named."""
    assert n == 2
    model, opt = _model(n)

    def nudge(step: int) -> None:
        if step == 2 and process_index() == 0:
            with torch.no_grad():
                model.layers[1].mlp.fc2.bias.shards[0].add_(1.0)

    failed = _train(model, opt, 2, torch.ones(4, 8), nudge)
    assert failed == 2, (failed, _ERRORS)
    assert ("layers.1.mlp.fc2.bias (Replicated over mesh axes ['tp'] of DeviceMesh(tp=2)): "
            "ranks 0 and 1 hold different copies, with no majority") in _ERRORS[-1], _ERRORS


def body_check_off_installs_nothing(n: int) -> None:
    """Without the option nothing is installed and training runs as before."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    assert replicas.ENABLED is None
    assert not _global_optimizer_post_hooks, _global_optimizer_post_hooks
    model, opt = _model(n)
    if process_index() == 1:
        with torch.no_grad():
            model.layers[0].mlp.fc2.bias.shards[1].add_(1.0)  # unchecked: no error
    assert _train(model, opt, 2, torch.ones(4, 4 * n)) == 0
    assert not _global_optimizer_post_hooks
