"""reshape keeps a split, merged or regrouped dim sharded on its run's first dim when
every block stays contiguous (attention's view into heads), and gathers otherwise.

The rule ``"reshape"`` alone decides (compound dims, :mod:`shardwise.propagation.rules`);
:func:`contiguous_dims`, the contiguity check that decided first before the rule
owned reshape, is kept here as its oracle: wherever the check keeps every block where
it is, the rule does too, with the same output layout.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise import DeviceMesh, DimSpec, PlacementMapping, Replicated, Sharded, ShardingSpec
from shardwise.debug import CommCounter
from shardwise.propagation.binding import bind
from shardwise.propagation.decide import Decision, decide
from shardwise.sharding import Layout, ReduceOp
from shardwise.sharding.shapes import reshape_groups
from tests.helpers.computecheck import lay, make, run, show, values
from tests.helpers.meshes import M24 as MESH
from tests.helpers.shardcheck import global_of, whole_value

DP, TP = 0, 1


def contiguous_dims(src: Sequence[int], new: Sequence[int], dims: Sequence[tuple[int, ...]],
                    mesh_shape: Sequence[int]) -> tuple[tuple[int, ...], ...] | None:
    """The oracle: the sharding of each dim of ``new`` when a tensor of shape ``src``,
    its dims sharded over the mesh axes ``dims``, is reshaped to ``new`` with every
    block reshaped where it is, or None when some block would not be a block.

    In a run (``reshape_groups``) that splits, merges or regroups dims only its first
    source dim may be sharded, over ``n`` devices dividing both that dim and the first
    target dim: the ``k``-th block is then the ``k``-th contiguous ``1/n`` of the run
    either way.
    """
    out: list[tuple[int, ...]] = [()] * len(new)
    if tuple(src) == tuple(new):  # nothing moves (compute never asked the check)
        return tuple(dims)
    if math.prod(src) == 0:
        return tuple(out) if not any(dims) else None
    for gi, gj in reshape_groups(src, new):
        if not gj:  # a dropped size-1 dim
            if dims[gi[0]]:
                return None
            continue
        if not gi:  # a new size-1 dim
            continue
        if any(dims[d] for d in gi[1:]):
            return None
        axes = dims[gi[0]]
        n = math.prod(mesh_shape[a] for a in axes)
        if (len(gi) == 1 and len(gj) == 1) or (src[gi[0]] % n == 0 and new[gj[0]] % n == 0):
            out[gj[0]] = axes
        else:
            return None
    return tuple(out)


def decision(src: tuple[int, ...], new: tuple[int, ...], layout: Layout,
             opens: tuple[bool, ...] | None = None) -> Decision:
    return decide(bind("reshape", (src,), new), (layout,), (opens,), (8,))


def rule_dims(src: tuple[int, ...], new: tuple[int, ...], dims: tuple[tuple[int, ...], ...],
              mesh_shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...] | None:
    """The rule's output dims when it keeps the operand as it is, else None."""
    mesh = DeviceMesh.cpu(mesh_shape, ("a", "b", "c")[:len(mesh_shape)])
    layout = Layout(mesh, dims, (None,) * mesh.ndim)
    dec = decision(src, new, layout)
    return dec.output.dims if dec.required[0] == layout else None


@pytest.mark.parametrize("src,new,dims,want", [
    ((2, 32), (2, 4, 8), ((), (TP,)), ((), (TP,), ())),          # split: heads sharded
    ((2, 4, 8), (2, 32), ((), (TP,), ()), ((), (TP,))),          # merge back
    ((8, 16, 32), (128, 32), ((DP,), (), (TP,)), ((DP,), (TP,))),  # flatten(0, 1)
    ((2, 32), (2, 2, 16), ((), (TP,)), None),                    # 2 heads over 4 devices
    ((2, 4, 8), (2, 32), ((), (), (TP,)), None),                 # the minor dim sharded
    ((8, 16), (128,), ((DP,), (TP,)), None),                     # both dims of a run
    ((8, 1, 6), (8, 6), ((DP,), (), (TP,)), ((DP,), (TP,))),      # a size-1 dim dropped
    ((1, 8), (8,), ((TP,), ()), None),                           # a sharded size-1 dim
    ((16, 6), (8, 2, 6), ((DP, TP), ()), ((DP, TP), (), ())),    # over two mesh axes
    ((16, 6), (4, 4, 6), ((DP, TP), ()), None),                  # 4 rows, 8 devices
    ((0, 4), (4, 0), ((), ()), ((), ())),
    ((0, 8), (8, 0), ((), (TP,)), None),                         # size 0: gathered
    ((8, 6), (8, 1, 6), ((DP,), (TP,)), ((DP,), (), (TP,))),      # a new size-1 dim
    # regroups: the first dims share gcd(a, b), which n must divide
    ((8, 6), (4, 12), ((TP,), ()), ((TP,), ())),
    ((6, 4), (4, 6), ((DP,), ()), ((DP,), ())),
    ((6, 4), (4, 6), ((TP,), ()), None),                         # gcd 2, 4 devices
    ((12, 5, 2), (10, 12), ((DP,), (), ()), ((DP,), ())),
    ((8, 6), (4, 12), ((), (TP,)), None),                        # a minor sharded
    ((3, 4), (4, 3), ((DP,), ()), None),                         # coprime: gcd 1
    ((3, 4, 6), (3, 24), ((TP,), (DP,), ()), ((TP,), (DP,))),    # 3 rows over 4: kept
    ((3, 5, 6), (3, 2, 15), ((TP,), (), (DP,)), None),           # a regroup's minor
])
def test_rule_keeps_what_the_contiguity_check_keeps(
        src: tuple[int, ...], new: tuple[int, ...], dims: tuple[tuple[int, ...], ...],
        want: object) -> None:
    assert contiguous_dims(src, new, dims, (2, 4)) == want
    assert rule_dims(src, new, dims, (2, 4)) == want


@st.composite
def reshapes(draw: st.DrawFn) -> tuple:
    mesh_shape = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 3))))
    src = tuple(draw(st.lists(st.integers(0, 12), max_size=4)))
    numel = math.prod(src)
    if numel == 0:
        new = draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))
        new[draw(st.integers(0, len(new) - 1))] = 0
    else:  # the prime factors of numel regrouped, size-1 dims sprinkled in
        primes, n, p = [], numel, 2
        while n > 1:
            while n % p == 0:
                primes.append(p)
                n //= p
            p += 1
        primes = draw(st.permutations(primes))
        cuts = sorted(draw(st.lists(st.integers(0, len(primes)), max_size=4)))
        bounds = [0, *cuts, len(primes)]
        new = [math.prod(primes[i:j]) for i, j in itertools.pairwise(bounds)]
    dims: list[list[int]] = [[] for _ in src]
    for a in range(len(mesh_shape)):
        if src and draw(st.booleans()):
            dims[draw(st.integers(0, len(src) - 1))].append(a)
    return mesh_shape, src, tuple(new), tuple(tuple(d) for d in dims)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshapes())
def test_rule_equals_the_contiguity_check(case: tuple) -> None:
    mesh_shape, src, new, dims = case
    assert rule_dims(src, new, dims, mesh_shape) == contiguous_dims(src, new, dims, mesh_shape)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshapes(), st.sampled_from([None, ReduceOp.SUM, ReduceOp.MAX]))
def test_values_on_random_layouts(case: tuple, op: ReduceOp | None) -> None:
    mesh_shape, src, new, dims = case
    mesh = DeviceMesh.cpu(mesh_shape, ("a", "b", "c")[:len(mesh_shape)])
    free = [a for a in range(mesh.ndim) if not any(a in d for d in dims)]
    partial = tuple(op if free and a == free[0] else None for a in range(mesh.ndim))
    x = make(torch.randn(src, dtype=torch.float64), Layout(mesh, dims, partial), grad=False)
    with CommCounter() as cc:
        y = x.reshape(new)
    torch.testing.assert_close(global_of(y), global_of(x).reshape(new))
    kept = rule_dims(src, new, dims, mesh_shape) is not None
    # every Partial passes, except where resolving it moves 0 bytes (an empty tensor, a
    # size-1 mesh axis) and the operand changes anyway: a tie broken either way
    if kept or (math.prod(src) and free and mesh_shape[free[0]] > 1):
        assert y.dist_layout.partial == partial
    if kept:
        assert cc.total == 0


# --- the rule's decisions, case by case -------------------------------------------------
def test_runs_are_decided_one_by_one() -> None:
    # the regroup (8, 6) -> (4, 12) keeps dp; the split of the last dim cannot keep tp
    # (2 heads over 4 devices) and gathers it, without gathering the regroup too
    dec = decision((8, 6, 8), (4, 12, 2, 4), lay(MESH, "dp", None, "tp"))
    assert show_layout(dec.required[0]) == "[S(dp), R, R]"
    assert show_layout(dec.output) == "[S(dp), R, R, R]"


def test_uneven_majors_gather_and_uneven_kept_dims_stay() -> None:
    # the major of a split, a merge and a regroup: sharded only where it divides evenly
    for src, new, layout in (((2, 32), (2, 2, 16), lay(MESH, None, "tp")),   # 2 over 4
                             ((6, 4), (24,), lay(MESH, "tp", None)),           # 6 over 4
                             ((6, 4), (4, 6), lay(MESH, "tp", None))):         # gcd 2
        dec = decision(src, new, layout)
        assert dec.required[0] is not None and not dec.required[0].sharded_axes, (src, new)
    # a dim the reshape leaves as it is keeps even an uneven sharding (3 rows over 4)
    dec = decision((3, 4, 5), (3, 2, 10), lay(MESH, "tp", None, None))
    assert show_layout(dec.output) == "[S(tp), R, R]"


def test_size_zero_and_size_one_dims() -> None:
    dec = decision((0, 8), (8, 0), lay(MESH, None, "tp"))
    assert show_layout(dec.required[0]) == "[R, R]" and dec.local_shapes[0] == (8, 0)
    dec = decision((0, 8), (2, 0, 4), lay(MESH, None, None))
    assert dec.cost == 0 and show_layout(dec.output) == "[R, R, R]"
    # size-1 dims: a new one is unsharded, a dropped one is gathered if sharded
    dec = decision((8, 6), (8, 1, 6, 1), lay(MESH, "dp", "tp"))
    assert dec.cost == 0 and show_layout(dec.output) == "[S(dp), R, S(tp), R]"
    dec = decision((1, 8), (8,), lay(MESH, "tp", "dp"))
    assert show_layout(dec.required[0]) == "[R, S(dp)]"
    assert show_layout(dec.output) == "[S(dp)]"


def test_minus_one_is_inferred_before_deciding() -> None:
    layout = lay(MESH, "dp", None, "tp")
    assert bind("reshape", ((8, 16, 32),), (-1, 32)).out_shape == (128, 32)
    assert decision((8, 16, 32), (-1, 32), layout).output == decision(
        (8, 16, 32), (128, 32), layout).output
    x = sw.tensor(values(2, 4, 32), sharding=lay(MESH, "dp", None, "tp"))
    with CommCounter() as cc:
        y = x.view(2, 4, 4, -1)
    assert cc.total == 0 and show(y) == "[S(dp), R, S(tp), R]" and tuple(y.shape) == (2, 4, 4, 8)
    with pytest.raises(sw.ShardingError, match="cannot infer -1"):
        x.view(3, -1)


def show_layout(layout: Layout | None) -> str:
    assert layout is not None
    return str(layout)[len(repr(layout.mesh)):]


# --- closed dims: ShardingSpec with closed DimSpecs ---------------------------------------
@pytest.mark.parametrize("shape,new,comm,want,open_", [
    ((8, 6), (4, 12), 0, "[S(tp), R]", (False, True)),   # regroup: kept, still closed
    ((8, 6), (48,), 0, "[S(tp)]", (False,)),             # merge
    ((8, 6), (4, 2, 6), 0, "[S(tp), R, R]", (False, True, True)),  # split
    ((6, 4), (4, 6), 1, "[R, R]", (False, True)),        # uneven (gcd 2): gathered anyway
])
def test_closed_dims(shape: tuple[int, ...], new: tuple[int, ...], comm: int, want: str,
                     open_: tuple[bool, ...]) -> None:
    value = values(*shape)
    x = sw.shard(value, MESH, ShardingSpec(MESH, [DimSpec(("tp",)), DimSpec((), is_open=True)]))
    assert x._open == (False, True)
    with CommCounter() as cc:
        y = x.reshape(new)
    assert cc.total == comm and show(y) == want and y._open == open_
    torch.testing.assert_close(y.to_torch(), value.reshape(new))


def test_a_closed_minor_dim_is_gathered_at_the_penalty() -> None:
    # the closed dim is the regroup's minor: every choice changes it
    dec = decision((8, 6), (4, 12), lay(MESH, "dp", "tp"), opens=(True, False))
    assert show_layout(dec.required[0]) == "[S(dp), R]" and dec.out_open is None


# --- Partial inputs: every reduce op passes (reshape only moves elements) ----------------
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG])
@pytest.mark.parametrize("dims,shape,new,want", [
    (("tp", None), (8, 6), (4, 12), "[S(tp), R]"),
    ((None, "tp"), (2, 32), (2, 4, 8), "[R, S(tp), R]"),
    ((None, None), (2, 32), (2, 4, 8), "[R, R, R]"),
])
def test_partial_passes(op: ReduceOp, dims: tuple[str | None, ...], shape: tuple[int, ...],
                        new: tuple[int, ...], want: str) -> None:
    layout = lay(MESH, *dims, partial={"dp": op})
    out, cc = run(lambda x: x.reshape(new), lambda x: x.reshape(new), [(values(*shape), layout)],
                  grad=op is ReduceOp.SUM)
    assert cc.total == 0 and show(out) == f"{want} partial dp:{op.value}"


def test_partial_with_a_gathered_dim() -> None:
    # the minor of the regroup is gathered over tp; the Partial over dp stays
    layout = lay(MESH, None, "tp", partial={"dp": ReduceOp.MAX})
    out, cc = run(lambda x: x.reshape(4, 12), lambda x: x.reshape(4, 12),
                  [(values(8, 6), layout)], grad=False)
    assert dict(cc.counts) == {"all_gather": 1} and show(out) == "[R, R] partial dp:max"


# --- values, gradients and collectives through the Tensor -------------------------------
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "blocks"])
@pytest.mark.parametrize("placements,shape,new,comm", [
    ([Sharded(0), Sharded(2)], (2, 16, 32), (2, 16, 4, 8), 0),
    ([Sharded(0), Sharded(2)], (2, 16, 32), (2, 16, 2, 16), 1),  # 2 heads, 4 devices
    ([Sharded(0), Sharded(1)], (4, 8, 6), (32, 6), 1),           # dp's and tp's dims
    ([Sharded(0), Sharded(2)], (4, 8, 12), (32, 12), 0),
    ([Replicated(), Sharded(0)], (8, 6), (4, 2, 6), 0),
    ([Replicated(), Sharded(0)], (8, 6), (2, 4, 6), 1),          # 2 rows, 4 devices
    ([Sharded(1), Replicated()], (3, 4, 5), (3, 2, 10), 0),      # uneven elsewhere
    ([Replicated(), Sharded(0)], (8, 6), (4, 12), 0),            # regroup
    ([Sharded(0), Replicated()], (6, 4), (4, 6), 0),             # regroup, gcd 2 over dp
    ([Replicated(), Sharded(0)], (6, 4), (4, 6), 1),             # gcd 2, 4 devices
    ([Sharded(0), Sharded(2)], (8, 6, 8), (4, 12, 2, 4), 1),     # regroup kept, split not
    ([Sharded(1), Sharded(0)], (8, 6), (4, 12), 1),              # tp kept, dp gathered
])
def test_values_gradients_and_communication(placements: list[object],
                                            shape: tuple[int, ...], new: tuple[int, ...],
                                            comm: int, whole: bool) -> None:
    value = torch.randn(shape, dtype=torch.float64)
    mapping = PlacementMapping(MESH, placements)
    x = (sw.tensor(value, sharding=mapping).requires_grad_() if whole else
         sw.tensor(value, sharding=mapping, requires_grad=True))
    assert (whole_value(x) is not None) == whole
    with CommCounter() as cc:
        y = x.reshape(new)
    assert cc.total == comm
    assert (whole_value(y) is not None) == whole  # whole values stay whole
    torch.testing.assert_close(y.detach().to_torch(), value.reshape(new))
    w = torch.randn(new, dtype=torch.float64)
    (y * w).sum().backward()
    assert x.grad.dist_layout == x.dist_layout
    torch.testing.assert_close(x.grad.to_torch(), w.reshape(shape))
    back = y.reshape(shape)
    torch.testing.assert_close(back.detach().to_torch(), value)


def test_kept_blocks_are_views_of_the_input_blocks() -> None:
    # no block moves: each output block is the input block reshaped where it is
    x = make(values(8, 6), lay(MESH, "tp", None), grad=True)
    assert whole_value(x) is None
    y = x.reshape(4, 12)
    for a, b in zip(x._shards, y._shards):
        assert b._base is a or b._base is a._base or b.data_ptr() == a.data_ptr()
    torch.testing.assert_close(global_of(y), global_of(x).reshape(4, 12))
