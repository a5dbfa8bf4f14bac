"""A Hugging Face Llama parallelized on real Gloo processes (hf_plan on tp, or
fully_shard on dp, on 2 ranks; both, 2x2, on 4): ``save_pretrained`` with the gathered
state dict (every rank calls it, rank 0 writes) loads into a plain model with equal
weights, and ``generate()`` gives torch's tokens on every rank; Mixtral's experts run on
``torch._grouped_mm``'s rule over each process's own blocks. One bounded launch runs
every body of ``hf_bodies`` per world size (see ``harness.py``: 2 ranks ~17 s, 4 ranks
~28 s on 2 cores)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.helpers import hf_bodies  # imports transformers: the `hf` test extra
from tests.helpers.harness import check_body


@pytest.fixture(autouse=True, scope="module")
def _checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The folder every rank writes to and reads from (spawned ranks inherit it)."""
    before = os.environ.get("SHARDWISE_HF_TEST_DIR")
    os.environ["SHARDWISE_HF_TEST_DIR"] = str(tmp_path_factory.mktemp("hf_gloo"))
    yield
    if before is None:
        del os.environ["SHARDWISE_HF_TEST_DIR"]
    else:
        os.environ["SHARDWISE_HF_TEST_DIR"] = before


@pytest.mark.parametrize("name", hf_bodies.BODIES)
def test_hf_body_on_gloo(name: str) -> None:
    check_body(hf_bodies.__name__, hf_bodies.BODIES, 2, name)


@pytest.mark.parametrize("name", hf_bodies.BODIES_4)
def test_hf_body_on_4_gloo_ranks(name: str) -> None:
    check_body(hf_bodies.__name__, hf_bodies.BODIES_4, 4, name)
