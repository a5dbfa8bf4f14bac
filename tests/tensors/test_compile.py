"""torch.compile of a parallelized forward: values equal to eager shardwise (and to
plain torch), and no recompile storm: Dynamo compiles no frame of shardwise's own code
but the compile entry points (it would guard on its Python state), so repeated calls
with new inputs compile nothing new and no recompile_limit warning comes from
shardwise. (tests/api/test_compiling.py: graph breaks, backward, collectives.)

Kept fast: a tiny MLP, Dynamo's ``eager`` backend (guards and graph breaks are
Dynamo's, whatever the backend), ``torch._dynamo.reset()`` around each test.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
import torch.nn as nn

from shardwise import DeviceMesh
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

MESH = DeviceMesh.cpu(2, "tp")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def dynamo_log() -> Iterator[Records]:
    torch._dynamo.reset()
    torch._logging.set_logs(recompiles=True)
    handler = Records()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()


def test_compiled_parallel_forward_equals_eager_without_recompiles(dynamo_log: Records) -> None:
    torch.manual_seed(0)
    ref = MLP()
    model = parallelize_module(copy.deepcopy(ref), MESH,
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        for step in range(6):  # new inputs each call: nothing may recompile for them
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            got, eager = compiled(x), model(x)
            assert torch.equal(got.to_torch(), eager.to_torch())
            torch.testing.assert_close(got.to_torch(), ref(x))
    text = "\n".join(dynamo_log.messages)
    assert "recompile_limit" not in text
    assert "shardwise" not in text, text  # no guard on shardwise's state failed


def test_no_frame_of_shardwise_is_compiled_but_the_entry_points() -> None:
    from torch._dynamo import trace_rules

    import shardwise.ops.execute as execute_module
    import shardwise.parallel.style as style_module
    import shardwise.tensors.tensor as tensor_module
    import shardwise.tensors.traced as traced_module

    for skipped in (tensor_module, execute_module):
        assert trace_rules.check_file(skipped.__file__).skipped
    for traced in (traced_module, style_module):
        assert not trace_rules.check_file(traced.__file__).skipped

