"""The process transport's backend choices, without processes or a GPU (torch's calls
faked): the backends it refuses when built, the stream group each transfer runs on
where tags do not separate streams (NCCL), and the device a received block lands on.
The transport reaches the runtime through the Backend protocol (``backend.link``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DeviceMesh, PlacementMapping, Sharded
from shardwise.pipelining import transport_process
from shardwise.pipelining.transport_process import ProcessTransport
from shardwise.runtime.process import backend as process_backend
from shardwise.runtime.process import p2p
from shardwise.runtime.process.world import WORLD
from shardwise.runtime.world import C10D
from shardwise.sharding.errors import CollectiveError, ShardingError
from tests.helpers.fake_world import clean_world

MESH = DeviceMesh.cpu((2, 2), ("pp", "tp"))
STAGES = [MESH.submesh(pp=0), MESH.submesh(pp=1)]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Rank 0 of a 4-process world on ``state["backend"]``, a GPU and NCCL present;
    ``state["sent"]``/``["received"]`` record the p2p calls (peer, tag, key, pg)."""
    state: dict[str, Any] = {"backend": "gloo", "sent": [], "received": []}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    # shardwise reads torch's world record itself (runtime/world.py): a default group
    monkeypatch.setattr(C10D, "_default_pg", object())
    monkeypatch.setattr(dist, "get_backend", lambda group=None: state["backend"])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(p2p, "send_parts", lambda info, tensors, peer, tag, key, pg=None:
                        state["sent"].append((peer, tag, key, pg)))

    def recv(peer: int, tag: int, key: str, pg: Any = None) -> Any:
        state["received"].append((peer, tag, key, pg))
        return [p2p.spec_text(torch.utils._pytree.tree_flatten(None)[1]), [["v", None]]], []

    monkeypatch.setattr(p2p, "recv_parts", recv)
    with clean_world():
        yield state


@pytest.mark.parametrize(("backend", "gpu", "nccl", "match"), [
    ("mpi", True, True, r"runs on Gloo or NCCL; this run's backend is 'mpi'"),
    ("nccl", False, True, r"backend is 'nccl'.*torch.cuda.is_available\(\) is False"),
    ("nccl", True, False, r"'nccl' but this torch build has no NCCL"),
])
def test_a_backend_it_cannot_run_on_is_refused_when_built(
        fake: dict[str, Any], monkeypatch: pytest.MonkeyPatch, backend: str, gpu: bool,
        nccl: bool, match: str) -> None:
    fake["backend"] = backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    with pytest.raises(ShardingError, match=r"^The pipeline transport between processes.*"
                       + match):
        ProcessTransport(STAGES)


def test_gloo_transfers_share_the_world_group_by_tag(fake: dict[str, Any]) -> None:
    t = ProcessTransport(STAGES)
    t.send(torch.ones(2), 0, 1, "F0")
    t.recv(1, 0, "B0")
    up, down = p2p.stream_tag(0, 1), p2p.stream_tag(1, 0)
    assert fake["sent"] == [(2, up, "F0 from stage 0 to stage 1", None)]
    assert fake["received"] == [(2, down, "B0 from stage 1 to stage 0", None)]


def test_nccl_transfers_run_on_their_streams_group(fake: dict[str, Any]) -> None:
    fake["backend"] = "nccl"
    t = ProcessTransport(STAGES)
    with pytest.raises(ShardingError, match=r"stage 0 \(rank 0\) to stage 1 \(rank 2\): "
                       r"this backend \('nccl'\) needs a process group per stream.*"
                       r"prepare_stages"):
        t.send(torch.ones(2), 0, 1, "F0")
    up, down = p2p.stream_tag(0, 1), p2p.stream_tag(1, 0)
    WORLD.streams.update({(0, 2, up): "pg 0->2", (2, 0, down): "pg 2->0",
                          (1, 3, up): "pg 1->3"})
    t.send(torch.ones(2), 0, 1, "F0")
    t.recv(1, 0, "B0")
    assert fake["sent"][-1] == (2, up, "F0 from stage 0 to stage 1", "pg 0->2")
    assert fake["received"] == [(2, down, "B0 from stage 1 to stage 0", "pg 2->0")]


def test_a_received_block_lands_on_the_meshs_device(fake: dict[str, Any],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Where NCCL's message lives (this GPU) is not where a CPU mesh's block lives: the
    block moves to the backend's ``device_of(mesh, k)`` (faked: the meta device), asked
    when the transport is built (once per end of a link), never per transfer."""
    sub = STAGES[1]
    x = sw.tensor(torch.ones(4, 4), sharding=PlacementMapping(sub, [Sharded(0)]))
    meta = transport_process._layout_meta(x)
    asked: list[tuple[DeviceMesh, int]] = []
    monkeypatch.setattr(process_backend, "device_of", lambda mesh, k: asked.append((mesh, k))
                        or torch.device("meta"))
    monkeypatch.setattr(p2p, "recv_parts", lambda peer, tag, key, pg=None: (
        [p2p.spec_text(torch.utils._pytree.tree_flatten((0, 0))[1]), [meta, meta]],
        [torch.ones(2, 4), torch.ones(2, 4)]))
    t = ProcessTransport(STAGES)
    for _ in range(2):
        got = t.recv(1, 0, "B0")
        for y in got:
            block = y._shards[0]
            assert block is not None and block.device == torch.device("meta")
            assert tuple(block.shape) == (2, 4) and y.shape == (4, 4)
    assert asked == [(STAGES[0], 0)] * 2  # the send and the receive end, not per transfer
    same = torch.ones(2, 4)
    link = t._recvs[(1, 0)][0]
    assert transport_process._rebuild(meta, same, STAGES[0], 0, "F0", link, torch.device("cpu")
                                      )._shards[0] is same


def test_a_leaf_a_transfer_cannot_carry_is_refused_naming_its_type() -> None:
    with pytest.raises(CollectiveError, match=r"^Pipeline send: cannot send a leaf of type "
                                              r"object .*None, bool, int, float or str"):
        transport_process._part(object(), STAGES[0], 0)
    assert transport_process._part(2.5, STAGES[0], 0) == (["v", 2.5], None)
