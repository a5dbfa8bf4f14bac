"""One torch thread for a test module: tiny blocks on a loaded 2-core machine gain
nothing from torch's thread pool, only its waits. Import ``one_thread`` into a test
module or conftest to use it (it is autouse there)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
