"""The distributed Tensor: construction, inspection, buffer sharing and immutability."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import shardwise as sw
from shardwise import (
    CPU,
    DeviceMesh,
    NamedMapping,
    Partial,
    PlacementMapping,
    ReduceOp,
    Replicated,
    Sharded,
    ShardingError,
    ShardingSpec,
)
from shardwise.sharding import ConversionError, DistributedTensorType, Layout
from tests.helpers.meshes import M4, M22


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def on(mesh: DeviceMesh, *placements) -> PlacementMapping:
    return PlacementMapping(mesh, list(placements))


# --- construction ------------------------------------------------------------------------
@pytest.mark.parametrize("data", [
    [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
    np.arange(6.0).reshape(3, 2),
    torch.arange(6.0).reshape(3, 2),
], ids=["list", "numpy", "torch"])
def test_tensor_from_host_data(data) -> None:
    want = torch.as_tensor(np.asarray(data), dtype=torch.float64 if isinstance(
        data, np.ndarray) else torch.float32)
    x = sw.tensor(data)
    assert x.dist_device == CPU(0) and x.mesh.is_single
    assert x.shape == (3, 2) and x.dtype == want.dtype
    assert torch.equal(x.to_torch(), want)
    y = sw.tensor(data, sharding=on(M22, Sharded(0), Replicated()))
    assert torch.equal(y.to_torch(), want)
    assert [tuple(s.shape) for s in y.shards] == [(2, 2), (2, 2), (1, 2), (1, 2)]


def test_tensor_copies_host_data_once() -> None:
    src = torch.zeros(4, 2)
    arr = np.zeros((4, 2), dtype=np.float32)
    x = sw.tensor(src, sharding=on(M4, Sharded(0)))
    a = sw.tensor(arr, sharding=on(M4, Sharded(0)))
    src += 1
    arr += 1
    assert torch.equal(x.to_torch(), torch.zeros(4, 2))
    assert torch.equal(a.to_torch(), torch.zeros(4, 2))
    # shards are views of that one copy
    assert len({ptr(s) for s in x.shards}) == 1
    assert ptr(x.shards[0]) != ptr(src)


def test_tensor_scalars_dtypes_and_devices() -> None:
    z = sw.tensor(3.5)
    assert z.shape == () and z.ndim == 0 and z.item() == 3.5 and z.tolist() == 3.5
    with pytest.raises(TypeError, match="0-d"):
        len(z)
    assert sw.tensor([1, 2, 3]).dtype == torch.int64
    assert sw.tensor([1, 2], dtype=torch.float64).dtype == torch.float64
    assert sw.tensor([1.0], device=CPU(3)).dist_device == CPU(3)
    assert sw.tensor([True, False]).dtype == torch.bool


def test_tensor_from_a_tensor_relayouts() -> None:
    x = sw.tensor(torch.arange(6.0).reshape(3, 2), sharding=on(M22, Sharded(0), Replicated()))
    y = sw.tensor(x, sharding=on(M22, Replicated(), Sharded(1)))
    assert y.placements == (Replicated(), Sharded(1))
    assert torch.equal(y.to_torch(), x.to_torch())
    d = sw.tensor(x, device=CPU(1), dtype=torch.float64)
    assert d.dist_device == CPU(1) and d.dtype == torch.float64
    assert torch.equal(d.to_torch(), x.to_torch().double())
    g = sw.tensor(x, requires_grad=True)
    assert g.requires_grad and g.is_leaf and not x.requires_grad


@pytest.mark.parametrize("sharding", [
    None,
    on(M4, Sharded(0)),
    on(M22, Sharded(1), Sharded(0)),
    NamedMapping(M22, (("tp", "dp"), None)),
    ShardingSpec(M22, [None, ("dp", "tp")]),
], ids=["single", "S0", "S1S0", "named-tp-dp", "spec"])
def test_filled_constructors(sharding) -> None:
    shape = (5, 6)
    cases = [
        (sw.zeros(shape, sharding=sharding), torch.zeros(shape)),
        (sw.ones(shape, sharding=sharding), torch.ones(shape)),
        (sw.full(shape, 7.0, sharding=sharding), torch.full(shape, 7.0)),
        (sw.zeros(shape, dtype=torch.int32, sharding=sharding),
         torch.zeros(shape, dtype=torch.int32)),
    ]
    for t, want in cases:
        assert t.shape == shape and t.dtype == want.dtype
        assert torch.equal(t.to_torch(), want)
    if sharding is not None:
        one_d = on(sharding.mesh, Sharded(0), *[Replicated()] * (sharding.mesh.ndim - 1))
        a = sw.arange(7, sharding=one_d)
        assert torch.equal(a.to_torch(), torch.arange(7))
        assert torch.equal(a.shards[0], torch.arange(7)[: a.shards[0].shape[0]])
    assert torch.equal(sw.arange(7, sharding=None).to_torch(), torch.arange(7))
    r1 = sw.randn(shape, seed=5, sharding=sharding)
    r2 = sw.randn(shape, seed=5, sharding=sharding)
    r3 = sw.randn(shape, seed=6, sharding=sharding)
    assert torch.equal(r1.to_torch(), r2.to_torch())
    assert not torch.equal(r1.to_torch(), r3.to_torch())
    g = sw.ones(shape, requires_grad=True, sharding=sharding)
    assert g.requires_grad and g.is_leaf
    assert not sw.ones(shape, sharding=sharding).requires_grad


def test_filled_constructors_make_each_shard_at_local_size() -> None:
    x = sw.zeros((1000, 4), sharding=on(M4, Sharded(0)))
    assert [s.shape[0] for s in x.shards] == [250] * 4
    assert all(s.untyped_storage().nbytes() == 250 * 4 * 4 for s in x.shards)
    r = sw.ones((8, 8), sharding=on(M22, Sharded(0), Replicated()))
    assert r.shards[0] is r.shards[1] and r.shards[2] is r.shards[3]
    assert r.shards[0] is not r.shards[2]


def test_zeros_like_keeps_layout() -> None:
    x = sw.tensor(torch.arange(6.0), sharding=on(M22, Sharded(0), Partial(ReduceOp.PROD)))
    z = sw.zeros_like(x)
    assert z.dist_layout == x.dist_layout and z.shape == x.shape
    assert torch.equal(z.to_torch(), torch.zeros(6))


def test_partial_creation_keeps_global_value() -> None:
    for op in ReduceOp:
        x = sw.full((3,), 2.0, sharding=on(M22, Partial(op), Sharded(0)))
        torch.testing.assert_close(x.to_torch(), torch.full((3,), 2.0))
        assert x.placements == (Partial(op), Sharded(0))


def test_from_local() -> None:
    parts = [torch.full((2, 3), float(k)) for k in range(4)]
    x = sw.from_local(parts, on(M4, Sharded(0)))
    assert x.shape == (8, 3)  # derived: even split
    assert all(s is p for s, p in zip(x.shards, parts, strict=True))
    assert torch.equal(x.to_torch(), torch.cat(parts))
    # replicated axis: the first replica is used everywhere
    y = sw.from_local(parts, on(M22, Replicated(), Sharded(0)), shape=(4, 3))
    assert y.shards[2] is parts[0] and y.shards[3] is parts[1]
    # partial
    p = sw.from_local([torch.tensor([float(k)]) for k in range(4)], on(M4, Partial()))
    assert p.shape == (1,) and torch.equal(p.to_torch(), torch.tensor([6.0]))
    g = sw.from_local(parts, on(M4, Sharded(0)), requires_grad=True)
    assert g.requires_grad and g.is_leaf


# --- inspection --------------------------------------------------------------------------
def test_inspection() -> None:
    x = sw.tensor(torch.arange(10.0).reshape(5, 2), sharding=on(M22, Sharded(0), Replicated()))
    assert x.shape == (5, 2) and x.size() == (5, 2) and x.size(0) == 5
    assert x.ndim == 2 and x.dim() == 2 and x.numel() == 10 and len(x) == 5
    assert x.dtype == torch.float32
    assert x.mesh is M22
    assert x.dist_layout == Layout(M22, ((0,), ()), (None, None))
    assert x.sharding == on(M22, Sharded(0), Replicated())
    assert x.placements == (Sharded(0), Replicated())
    assert x.local_shapes == [(3, 2), (3, 2), (2, 2), (2, 2)]
    assert x.dist_type == DistributedTensorType(torch.float32, (5, 2), M22,
                                           (Sharded(0), Replicated()))
    assert len(x.shards) == 4
    for k, dev in enumerate(M22.devices):
        assert x.local(dev) is x.shards[k]
    assert torch.equal(x.local(CPU(2)), torch.arange(10.0).reshape(5, 2)[3:])
    with pytest.raises(ShardingError, match=r"CPU\(9\)"):
        x.local(CPU(9))
    assert repr(x) == ("Tensor(shape=(5, 2), dtype=float32, "
                       "layout=DeviceMesh(dp=2, tp=2)[S(dp), R])")
    n = x.numpy()
    assert isinstance(n, np.ndarray) and np.array_equal(n, np.arange(10.0).reshape(5, 2))
    g, plain = x.detach().requires_grad_(), torch.arange(10.0).reshape(5, 2).requires_grad_()
    for t in (g, plain):  # torch's rule, and its way out
        with pytest.raises(RuntimeError, match=r"detach\(\)\.numpy\(\)"):
            t.numpy()
        assert np.array_equal(t.numpy(force=True), n)
    assert x.tolist() == torch.arange(10.0).reshape(5, 2).tolist()


def test_the_mixins_override_torchs_attributes() -> None:
    """Tensor's bases put its mixins before torch.Tensor, so their Python properties win
    over torch's C attributes (``grad`` read from torch would be the wrapper's, None)."""
    from shardwise.tensors.grad import GradMixin
    from shardwise.tensors.meta import MetaMixin
    from shardwise.tensors.tensor import Tensor

    assert not issubclass(GradMixin, torch.Tensor) and not issubclass(MetaMixin, torch.Tensor)
    for name in ("grad", "requires_grad", "data", "is_leaf", "grad_fn", "detach"):
        assert getattr(Tensor, name) is GradMixin.__dict__[name], name
    for name in ("shape", "dtype", "ndim", "device", "layout", "is_sparse", "size"):
        assert getattr(Tensor, name) is MetaMixin.__dict__[name], name
    w = torch.nn.Parameter(sw.tensor(torch.arange(4.0), sharding=on(M4, Sharded(0))))
    (w * w).sum().backward()
    assert isinstance(w.grad, Tensor) and torch.equal(w.grad.to_torch(), 2 * torch.arange(4.0))


def test_sharding_forms_by_layout() -> None:
    named = sw.tensor(torch.ones(4, 4), sharding=NamedMapping(M22, (("tp", "dp"), None)))
    assert named.sharding == NamedMapping(M22, (("tp", "dp"), None))
    with pytest.raises(ConversionError, match="'tp', 'dp'"):
        _ = named.placements
    mixed = sw.tensor(torch.ones(2), sharding=on(M22, Partial(ReduceOp.MAX), Partial()))
    assert mixed.sharding == on(M22, Partial(ReduceOp.MAX), Partial())
    r = repr(mixed)
    assert "partial dp:max, tp:sum" in r


def test_device_is_single_device_only() -> None:
    assert sw.tensor([1.0], device=CPU(2)).dist_device == CPU(2)
    with pytest.raises(ShardingError, match="4 devices"):
        _ = sw.tensor([1.0], sharding=on(M4, Replicated())).dist_device


def test_repr_shows_requires_grad() -> None:
    x = sw.ones((2,), requires_grad=True)
    assert repr(x).endswith("requires_grad=True)")
    assert "requires_grad" not in repr(x.detach())


def test_to_torch_is_a_new_tensor() -> None:
    x = sw.tensor(torch.arange(4.0))
    out = x.to_torch()
    out += 100
    assert torch.equal(x.to_torch(), torch.arange(4.0))
    r = sw.tensor(torch.arange(4.0), sharding=on(M4, Replicated()))
    assert ptr(r.to_torch()) != ptr(r.shards[0])


# --- sharing and views ------------------------------------------------------------------
def test_replicas_share_one_buffer() -> None:
    x = sw.tensor(torch.arange(8.0), sharding=on(M22, Replicated(), Replicated()))
    assert all(s is x.shards[0] for s in x.shards)
    y = sw.tensor(torch.arange(8.0), sharding=on(M22, Replicated(), Sharded(0)))
    assert y.shards[0] is y.shards[2] and y.shards[1] is y.shards[3]
    assert y.shards[0] is not y.shards[1]


def test_replicated_to_sharded_shards_are_views() -> None:
    x = sw.tensor(torch.arange(16.0).reshape(4, 4), sharding=on(M4, Replicated()))
    y = sw.shard(x, M4, on(M4, Sharded(0)))
    base = ptr(x.shards[0])
    assert all(ptr(s) == base for s in y.shards)
    assert [s.storage_offset() for s in y.shards] == [0, 4, 8, 12]
    z = sw.shard(x, M4, on(M4, Sharded(1)))  # non-contiguous views, still no copy
    assert all(ptr(s) == base for s in z.shards)


def test_all_gather_result_is_one_object() -> None:
    x = sw.tensor(torch.arange(10.0), sharding=on(M22, Sharded(0), Sharded(0)))
    y = sw.all_gather(x)
    assert all(s is y.shards[0] for s in y.shards)
    assert torch.equal(y.shards[0], torch.arange(10.0))
    b = sw.distributed_broadcast(sw.tensor(torch.ones(3)), M4)
    assert all(s is b.shards[0] for s in b.shards)


def test_all_reduce_result_is_one_object_per_group() -> None:
    x = sw.from_local([torch.full((2,), float(k)) for k in range(4)],
                      on(M22, Partial(), Replicated()))
    y = sw.all_reduce(x)
    assert all(s is y.shards[0] for s in y.shards)


def test_detach_shares_memory() -> None:
    x = sw.ones((4,), sharding=on(M4, Sharded(0)), requires_grad=True)
    d = x.detach()
    assert not d.requires_grad and x.requires_grad
    assert [ptr(s) for s in d.shards] == [ptr(s) for s in x.shards]


def test_requires_grad_only_on_leaves() -> None:
    x = sw.ones((4,), sharding=on(M4, Replicated()))
    assert x.requires_grad_() is x and x.requires_grad and x.is_leaf
    y = sw.shard(x, M4, on(M4, Sharded(0)))
    assert not y.is_leaf
    assert y.requires_grad_() is y  # as torch: a no-op on a non-leaf that records
    with pytest.raises(ShardingError, match="leaf"):
        y.requires_grad_(False)


# --- immutability ----------------------------------------------------------------------
def test_no_op_mutates_its_input() -> None:
    value = torch.arange(24.0).reshape(4, 6)
    x = sw.tensor(value, sharding=on(M22, Sharded(0), Replicated()))
    p = sw.from_local([torch.full((4, 6), float(k)) for k in range(4)],
                      on(M22, Partial(), Sharded(1)), shape=(4, 12))
    ops = [
        lambda t: sw.shard(t, M22, ["tp", "dp"]),
        lambda t: sw.all_gather(t),
        lambda t: sw.all_gather(t, 0),
        lambda t: sw.all_to_all(t, 1, 0) if t.dist_layout.dims[0] else sw.all_to_all(t, 0, 1),
        lambda t: sw.all_reduce(t),
        lambda t: sw.all_reduce(t, reduce_axes="tp", reduce_op="max"),
        lambda t: sw.reduce_scatter(t, 1),
        lambda t: sw.ppermute(t, [(0, 1), (1, 0)], axis_name="tp"),
        lambda t: sw.distributed_broadcast(t, M4),
        lambda t: sw.to_device(t, CPU(0)),
        lambda t: sw.to_device(t, sharding=on(M4, Sharded(1))),
        lambda t: sw.cpu(t),
        lambda t: t.to_torch(),
        lambda t: t.numpy(),
    ]
    for t in (x, p):
        ids = [id(s) for s in t.shards]
        values = [s.clone() for s in t.shards]
        layout = t.dist_layout
        for op in ops:
            op(t)
            assert [id(s) for s in t.shards] == ids
            assert all(torch.equal(a, b) for a, b in zip(t.shards, values, strict=True))
            assert t.dist_layout == layout


def test_python_scalar_conversions_and_invert_match_torch() -> None:
    """int(), operator.index(), float(), complex() and ~x read the global value as torch
    does (they share the ``__i`` prefix with the in-place ``__iadd__`` family, which
    is refused)."""
    import operator

    mesh = DeviceMesh.cpu((2,), ("x",))
    partial = sw.from_local([torch.tensor(3), torch.tensor(5)],
                            PlacementMapping(mesh, (Partial(),)), shape=())
    ref = torch.tensor(8)
    assert int(partial) == int(ref) and operator.index(partial) == 8
    assert float(partial) == 8.0 and complex(partial) == complex(ref)
    assert "abcdefghi"[partial] == "i"
    x = sw.tensor(torch.arange(4), sharding=PlacementMapping(mesh, (Sharded(0),)))
    assert torch.equal((~x).to_torch(), ~torch.arange(4))
    y = x.clone()
    y <<= 1  # a rule since the operators follow torch (tests/ops/test_operators.py)
    assert torch.equal(y.to_torch(), torch.arange(4) << 1)
    from shardwise.ops.registry import fallback

    with pytest.raises(ShardingError, match="in place"):  # one without a rule: by name
        fallback(torch.Tensor.__ilshift__, (x, 1), {})
