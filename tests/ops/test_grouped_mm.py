"""torch._grouped_mm (transformers' MoE experts) on rule ``grouped_mm``: values and
gradients equal torch's in every form (2-D x 3-D with offs, 3-D x 3-D, 2-D x 2-D, 3-D
x 2-D), whole values bit for bit; N sharded stays sharded (column-parallel experts), a
sharded K leaves Partial(SUM) (row-parallel); blocks whose strides the CPU kernel
refuses (a shard of an aligned dim) run one mm per group; what torch's kernel would
refuse falls back to torch, which raises."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Partial, Sharded
from tests.helpers.meshes import M2, M4, M22
from tests.helpers.opcheck import R, check, pm

S0, S1, S2 = Sharded(0), Sharded(1), Sharded(2)
OFFS = torch.tensor([3, 3, 10], dtype=torch.int32)  # an empty group in the middle


def rand(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


# (a's placements, b's placements): K = 8 and N = 12 split into blocks of 6 or 3
# columns (not 16-byte rows: the per-group loop) or 4 (the kernel)
ROWS_BY_GROUP = [
    (pm(M4, R), pm(M4, S2)),            # column-parallel experts, N blocks of 3
    (pm(M2, R), pm(M2, S2)),            # N blocks of 6
    (pm(M4, S1), pm(M4, S1)),           # row-parallel, K blocks of 2: Partial(SUM)
    (pm(M22, R, S1), pm(M22, S2, S1)),  # K on tp, the groups gathered
    (pm(M22, S0, R), pm(M22, R, S2)),   # the rows gathered, N on tp
    (pm(M4, R), pm(M4, R)),
]


@pytest.mark.parametrize("pa,pb", ROWS_BY_GROUP)
def test_rows_grouped_by_offs(pa: object, pb: object) -> None:
    check(grouped, [(rand(10, 8), pa), (rand(3, 8, 12, seed=2), pb), OFFS])


def test_transposed_experts_as_transformers_calls_them() -> None:
    """HF's experts store (G, N, K) and pass ``weight.transpose(-2, -1)``."""
    w = rand(3, 12, 8, seed=2)
    for pb in (pm(M2, S1), pm(M2, S2), pm(M22, R, S1)):
        check(lambda a, b, o: grouped(a, b.transpose(-2, -1), o),
              [(rand(10, 8), pm(pb.mesh, *[R] * pb.mesh.ndim)), (w, pb), OFFS])


@pytest.mark.parametrize("pa,pb", [(pm(M4, S0), pm(M4, S0)), (pm(M4, S1), pm(M4, R)),
                                   (pm(M22, S0, S2), pm(M22, S0, S1)),
                                   (pm(M2, R), pm(M2, S2))])
def test_batched_form(pa: object, pb: object) -> None:
    check(grouped, [(rand(4, 5, 8), pa), (rand(4, 8, 12, seed=2), pb)])


@pytest.mark.parametrize("pa,pb", [(pm(M4, S0), pm(M4, S1)), (pm(M2, R), pm(M2, R)),
                                   (pm(M22, S0, R), pm(M22, R, S1))])
def test_columns_grouped_forms(pa: object, pb: object) -> None:
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    check(grouped, [(rand(8, 12), pa), (rand(12, 8, seed=2), pb), offs])  # (G, K, N)
    check(grouped, [(rand(3, 8, 8), pa), (rand(8, 12, seed=2), pb), offs])  # (M, N)


def test_layouts_follow_the_rule() -> None:
    a, b = rand(10, 8), rand(3, 8, 12, seed=2)
    col = grouped(sw.tensor(a, sharding=pm(M22, R, R)), sw.tensor(b, sharding=pm(M22, R, S2)),
                  OFFS)
    assert col.placements == (R, S1)
    row = grouped(sw.tensor(a, sharding=pm(M22, R, S1)), sw.tensor(b, sharding=pm(M22, R, S1)),
                  OFFS)
    assert row.placements == (R, Partial())
    assert torch.equal(col.to_torch(), torch._grouped_mm(a, b, offs=OFFS))
    torch.testing.assert_close(row.to_torch(), torch._grouped_mm(a, b, offs=OFFS))


def test_offs_as_a_shardwise_tensor_and_through_F_grouped_mm() -> None:
    """transformers computes offs from shardwise Tensors (histc, cumsum) and calls
    F.grouped_mm, which calls torch._grouped_mm."""
    a, b = rand(10, 8), rand(3, 8, 12, seed=2)
    offs = sw.tensor(OFFS, sharding=pm(M2, R))
    check(lambda x, y: F.grouped_mm(x, y, offs=offs), [(a, pm(M2, R)), (b, pm(M2, S2))])


def test_what_torch_refuses_falls_back_to_torch() -> None:
    a, b = rand(10, 6), rand(3, 6, 12, seed=2)  # rows of 24 bytes: torch's kernel refuses
    with pytest.warns(sw.ShardwiseFallbackWarning, match="_grouped_mm"), pytest.raises(
            RuntimeError, match="16 bytes"):
        grouped(sw.tensor(a, sharding=pm(M2, R)), sw.tensor(b, sharding=pm(M2, S2)), OFFS)
    with pytest.raises(RuntimeError, match="int32"):  # the warning came once, above
        grouped(sw.tensor(rand(10, 8), sharding=pm(M2, R)),
                sw.tensor(rand(3, 8, 12), sharding=pm(M2, S2)), OFFS.long())


def test_blocks_the_kernel_refuses_run_one_mm_per_group(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    from shardwise.ops import matmuls

    seen: list[tuple[int, ...]] = []

    def loop(a: torch.Tensor, b: torch.Tensor, o: torch.Tensor | None) -> torch.Tensor:
        seen.append(tuple(b.shape))
        return grouped_loop(a, b, o)

    grouped_loop = matmuls._grouped_loop
    monkeypatch.setattr(matmuls, "_grouped_loop", loop)
    check(grouped, [(rand(10, 8), pm(M4, R)), (rand(3, 8, 16, seed=2), pm(M4, S2)), OFFS])
    assert seen == []  # blocks of 4 columns: the kernel
    check(grouped, [(rand(10, 8), pm(M4, R)), (rand(3, 8, 12, seed=2), pm(M4, S2)), OFFS])
    assert set(seen) == {(3, 8, 3)}  # blocks of 3 columns (12 bytes): the loop


def test_offs_out_of_range_is_an_error_on_the_loop() -> None:
    from shardwise.ops import matmuls

    with pytest.raises(ValueError, match=r"offs \[3, 12\] must increase and end within "
                                         r"the 10 grouped rows"):
        matmuls._grouped_loop(rand(10, 6), rand(2, 6, 4), torch.tensor([3, 12]))
