"""Checkpoints across processes: 4 Gloo ranks save (DCP, shardwise.checkpoint,
safetensors, a GPT run) and convert to/from DTensor; 2 Gloo ranks then load what they
saved, resharded. Two launches in all, every check batched into them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ckpt_bodies
from tests.helpers.harness import run_on_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    shared: Path = tmp_path_factory.mktemp("gloo_checkpoints")
    os.environ["SHARDWISE_CKPT_TEST_DIR"] = str(shared)  # inherited by the spawned ranks
    try:
        four = run_on_ranks(ckpt_bodies.__name__, ckpt_bodies.BODIES_4, 4, limit_s=240)
        two = run_on_ranks(ckpt_bodies.__name__, ckpt_bodies.BODIES_2, 2, limit_s=180)
    finally:
        del os.environ["SHARDWISE_CKPT_TEST_DIR"]
    return {4: four, 2: two}


def _assert_passed(results: dict[int, dict[str, str | None]], world: int, name: str) -> None:
    assert sorted(results) == list(range(world)), f"ranks that reported: {sorted(results)}"
    failures = {}
    for rank, res in results.items():
        for key in ("<setup>", "<exit>"):
            if res.get(key):
                failures[rank] = f"{key}: {res[key]}"
        if rank not in failures and name not in res:
            failures[rank] = f"{name} did not run (reported {sorted(res)})"
        elif rank not in failures and res[name]:
            failures[rank] = res[name]
    assert not failures, "\n".join(f"--- rank {r}\n{tb}" for r, tb in failures.items())


@pytest.mark.parametrize("name", ckpt_bodies.BODIES_4)
def test_on_4_ranks(results: dict[int, Any], name: str) -> None:
    _assert_passed(results[4], 4, name)


@pytest.mark.parametrize("name", ckpt_bodies.BODIES_2)
def test_on_2_ranks_loading_what_4_saved(results: dict[int, Any], name: str) -> None:
    _assert_passed(results[2], 2, name)


def test_a_peer_of_a_failed_load_names_the_rank_and_the_key(tmp_path: Path) -> None:
    os.environ["SHARDWISE_CKPT_TEST_DIR"] = str(tmp_path)  # inherited by the spawned ranks
    try:
        res = run_on_ranks(ckpt_bodies.__name__, ["body_peer_of_a_failed_load"], 2, limit_s=60,
                           timeout_s=3.0)
    finally:
        del os.environ["SHARDWISE_CKPT_TEST_DIR"]
    _assert_passed(res, 2, "body_peer_of_a_failed_load")
