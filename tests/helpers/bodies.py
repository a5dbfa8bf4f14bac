"""Test bodies shared by both runtimes: each takes the number of devices ``n``.

Run directly, they use a simulated mesh of ``n`` virtual CPU devices; run on
every rank of an ``n``-process Gloo group (see ``harness.py``), the same code
builds meshes over the processes. Data is deterministic, so every rank checks
the same global values.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate as TReplicate

import shardwise as sw
from shardwise import DeviceMesh, Partial, PlacementMapping, Replicated, Sharded
from tests.helpers.meshes import meshes_for

OPS = ["sum", "avg", "min", "max", "prod"]


def data(*shape: int) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    return (torch.arange(numel, dtype=torch.float32) % 7 - 3).reshape(shape)


def layouts(mesh: DeviceMesh, ndim: int) -> list[PlacementMapping]:
    opts = [Replicated(), Sharded(0), Sharded(ndim - 1), Partial()]
    if mesh.ndim == 1:
        return [PlacementMapping(mesh, [p]) for p in opts]
    return [PlacementMapping(mesh, [a, b]) for a in opts for b in opts[:3]]


def body_reshard_values(n: int) -> None:
    """Every source layout to every target layout keeps the global value."""
    for mesh in meshes_for(n):
        for shape in [(5, 3), (8, 4), (2, 6), (0, 4)]:
            x = data(*shape)
            for src in layouts(mesh, 2):
                t = sw.tensor(x, sharding=src)
                assert torch.equal(t.to_torch(), x), (src, shape)
                for dst in layouts(mesh, 2):
                    out = sw.shard(t, dim_specs=dst)
                    assert torch.equal(out.to_torch(), x), (src, dst, shape)


def body_collectives(n: int) -> None:
    mesh = DeviceMesh.cpu((n,), ("x",))
    x = data(7, 5)

    def pm(*p: object) -> PlacementMapping:
        return PlacementMapping(mesh, list(p))

    s0 = sw.tensor(x, sharding=pm(Sharded(0)))
    assert torch.equal(sw.all_gather(s0).to_torch(), x)
    a2a = sw.all_to_all(s0, 1, 0)
    assert a2a.placements == (Sharded(1),)
    assert torch.equal(a2a.to_torch(), x)
    for op in OPS:
        p = sw.tensor(x, sharding=pm(Partial(op)))
        assert torch.allclose(sw.all_reduce(p).to_torch(), x), op
        rs = sw.reduce_scatter(p, 0)
        assert rs.placements == (Sharded(0),)
        assert torch.allclose(rs.to_torch(), x), op
    # psum of a replicated value: n copies summed
    r = sw.tensor(x, sharding=pm(Replicated()))
    assert torch.equal(sw.all_reduce(r).to_torch(), n * x)
    # ppermute ring on an evenly sharded tensor
    y = data(4 * n, 2)
    ys = sw.tensor(y, sharding=pm(Sharded(0)))
    ring = sw.ppermute(ys, [(i, (i + 1) % n) for i in range(n)])
    expect = torch.cat([y[4 * ((i - 1) % n): 4 * ((i - 1) % n) + 4] for i in range(n)])
    assert torch.equal(ring.to_torch(), expect)
    partial_perm = sw.ppermute(ys, [(0, 1)])
    expect2 = torch.zeros_like(y)
    expect2[4:8] = y[0:4]
    assert torch.equal(partial_perm.to_torch(), expect2)
    b = sw.distributed_broadcast(sw.tensor(x), mesh)
    assert b.placements == (Replicated(),)
    assert torch.equal(b.to_torch(), x)


def _check_grad(fn, x: torch.Tensor, src: PlacementMapping) -> None:  # type: ignore[no-untyped-def]
    w = sw.tensor(x, sharding=src, requires_grad=True)
    out = fn(w)
    loss = (out.to_torch() * data(*out.shape)).sum()
    loss.backward()
    ref = x.clone().requires_grad_(True)
    (ref_fn(fn, ref) * data(*out.shape)).sum().backward()
    assert w.grad is not None
    got = w.grad.to_torch()
    assert torch.allclose(got, ref.grad), (src, got, ref.grad)  # type: ignore[arg-type]


def ref_fn(fn, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The single-device meaning of the layout ops used below: the identity."""
    return x


def body_gradients(n: int) -> None:
    for mesh in meshes_for(n):
        x = data(6, 4)
        for src in layouts(mesh, 2):
            for dst in layouts(mesh, 2):
                _check_grad(lambda t, dst=dst: sw.shard(t, dim_specs=dst), x, src)
        _check_grad(sw.all_gather, x, PlacementMapping(mesh, [Sharded(1)] * mesh.ndim
                                                       if mesh.ndim == 1 else
                                                       [Sharded(0), Sharded(1)]))
    mesh = DeviceMesh.cpu((n,), ("x",))
    # psum of a replicated value: d(n * x)/dx = n
    w = sw.tensor(data(3, 2), sharding=PlacementMapping(mesh, [Replicated()]),
                  requires_grad=True)
    sw.all_reduce(w).to_torch().sum().backward()
    assert w.grad is not None
    assert torch.equal(w.grad.to_torch(), torch.full((3, 2), float(n)))


def body_functional(n: int) -> None:
    mesh = DeviceMesh.cpu((n,), ("x",))
    x = data(5, 3)
    t = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0)]))

    def f(a: sw.Tensor) -> torch.Tensor:
        return sw.all_gather(sw.shard(a, dim_specs=PlacementMapping(mesh, [Sharded(1)])))

    value, g = sw.value_and_grad(lambda a: _sumsq(f(a)))(t)
    assert torch.allclose(value.to_torch(), (x * x).sum())
    assert g.placements == (Sharded(0),)
    assert torch.allclose(g.to_torch(), 2 * x)
    out, tan = sw.jvp(f, (t,), (torch.ones_like(x),))
    assert torch.equal(out.to_torch(), x)
    assert torch.equal(tan.to_torch(), torch.ones_like(x))


def _sumsq(t: sw.Tensor) -> sw.Tensor:
    """sum(t * t) as a replicated scalar Tensor on t's mesh (no compute ops needed)."""
    value = (t.to_torch() ** 2).sum()
    mesh = t.mesh
    return sw.from_local([value] * mesh.num_devices if not _is_dist() else
                         [value if k == _me(mesh) else None for k in range(mesh.num_devices)],
                         PlacementMapping(mesh, [Replicated()] * mesh.ndim), ())


def _is_dist() -> bool:
    import shardwise.distributed as sd

    return sd.is_initialized()


def _me(mesh: DeviceMesh) -> int:
    import shardwise.distributed as sd

    return [d.id for d in mesh.devices].index(sd.process_index())


BODIES = ["body_reshard_values", "body_collectives", "body_gradients", "body_functional"]


def body_holds_own_shards(n: int) -> None:
    """Under torch.distributed each process holds only its own shard."""
    mesh = DeviceMesh.cpu((n,), ("x",))
    t = sw.tensor(data(2 * n, 3), sharding=PlacementMapping(mesh, [Sharded(0)]))
    held = [k for k, s in enumerate(t.shards) if s is not None]
    if _is_dist():
        assert held == [_me(mesh)], held
        assert t.local(mesh.devices[held[0]]).shape == (2, 3)
        # DTensor's names: the one block this rank holds, differentiable
        x = t.detach().requires_grad_()
        block = x.to_local()
        assert torch.equal(block, t.shards[held[0]])
        whole = x.redistribute(x.device_mesh, [TReplicate()])
        assert torch.equal(whole.to_local(), data(2 * n, 3))
        assert torch.equal(x.full_tensor(), data(2 * n, 3))
        (block * (_me(mesh) + 1)).sum().backward()
        assert x.grad is not None
        assert torch.equal(x.grad.to_local(), torch.full((2, 3), float(_me(mesh) + 1)))
    else:
        assert held == list(range(n))


BODIES.append("body_holds_own_shards")


def body_comm_counts(n: int) -> None:
    """The same plan, and so the same collective counts, on both runtimes; data
    every process has is sliced locally with no communication at all."""
    from shardwise.debug import CommCounter
    from shardwise.runtime.process import collectives

    calls: list[str] = []
    original = collectives._call

    def counting(what, g, fn):  # type: ignore[no-untyped-def]
        calls.append(what)
        return original(what, g, fn)

    collectives._call = counting  # type: ignore[assignment]
    try:
        mesh = DeviceMesh.cpu((n,), ("x",))
        x = data(4 * n, 3)
        t = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0)]))
        assert calls == [], calls
        with CommCounter() as cc:
            sw.all_to_all(t, 1, 0)
            sw.all_reduce(sw.tensor(x, sharding=PlacementMapping(mesh, [Partial()])))
            sw.shard(sw.tensor(x, sharding=PlacementMapping(mesh, [Replicated()])),
                     dim_specs=PlacementMapping(mesh, [Sharded(1)]))
        assert dict(cc.counts) == {"all_to_all": 1, "all_reduce": 1}, cc.counts
        if _is_dist():
            assert calls == ["all_to_all", "all_reduce"], calls
    finally:
        collectives._call = original  # type: ignore[assignment]


def body_mesh_too_big(n: int) -> None:
    """A mesh with more devices than processes is an error, not a silent simulation."""
    if not _is_dist():
        return
    try:
        DeviceMesh.cpu((2 * n,), ("x",))
        sw.tensor(torch.ones(2 * n), sharding=PlacementMapping(
            DeviceMesh.cpu((2 * n,), ("x",)), [Sharded(0)]))
    except sw.ShardingError as err:
        assert "processes" in str(err), err
        return
    raise AssertionError("a mesh larger than the world was accepted")


BODIES += ["body_comm_counts", "body_mesh_too_big"]


def body_megatron(n: int) -> None:
    """Megatron MLP: x[S(0) on dp] @ W1[S(1) on tp] -> gelu -> @ W2[S(0) on tp] is
    Partial(SUM) over tp with no collectives; one all_reduce in the whole forward.
    Values and the gradients of x, W1, W2 equal single-device torch."""
    from shardwise.debug import CommCounter

    if n == 4:
        mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
        px, p1, p2 = [Sharded(0), Replicated()], [Replicated(), Sharded(1)], [Replicated(),
                                                                              Sharded(0)]
    else:
        mesh = DeviceMesh.cpu((n,), ("tp",))
        px, p1, p2 = [Replicated()], [Sharded(1)], [Sharded(0)]
    tp = mesh.axis_index("tp")
    xv, av, bv = data(6, 5) / 4, data(5, 2 * n + 1) / 5, data(2 * n + 1, 3) / 5

    def model() -> tuple[sw.Tensor, list[sw.Tensor]]:
        x = sw.tensor(xv, sharding=PlacementMapping(mesh, px), requires_grad=True)
        w1 = sw.tensor(av, sharding=PlacementMapping(mesh, p1), requires_grad=True)
        w2 = sw.tensor(bv, sharding=PlacementMapping(mesh, p2), requires_grad=True)
        with CommCounter() as cc:
            partial = sw.gelu(x @ w1) @ w2
            assert cc.total == 0, cc
            assert partial.dist_layout.partial[tp] is sw.ReduceOp.SUM, partial.dist_layout
            out = sw.all_reduce(partial)
        assert dict(cc.counts) == {"all_reduce": 1}, cc
        return out, [x, w1, w2]

    refs = [v.clone().requires_grad_(True) for v in (xv, av, bv)]
    expect = torch.nn.functional.gelu(refs[0] @ refs[1]) @ refs[2]
    (expect ** 2).sum().backward()
    # loss from the global torch value
    out, params = model()
    assert torch.allclose(out.to_torch(), expect, atol=1e-6)
    (out.to_torch() ** 2).sum().backward()
    for p, r in zip(params, refs):
        assert p.grad is not None and r.grad is not None
        assert torch.allclose(p.grad.to_torch(), r.grad, atol=1e-5), (p.grad.to_torch(), r.grad)
    # loss as a shardwise scalar
    out, params = model()
    loss = (out * out).sum()
    assert torch.allclose(loss.to_torch(), (expect ** 2).sum(), atol=1e-5)
    loss.backward()
    for p, r in zip(params, refs):
        assert p.grad is not None and r.grad is not None
        assert torch.allclose(p.grad.to_torch(), r.grad, atol=1e-5), (p.grad.to_torch(), r.grad)


BODIES.append("body_megatron")


def body_compute_grads(n: int) -> None:
    """Compute ops (with reshards, Partial pass-through and resolution, replicated
    operands of sharded outputs) give torch's values and gradients on both runtimes."""
    import operator

    for mesh in meshes_for(n):
        a = mesh.axis_names[-1]
        axis = mesh.axis_index(a)

        def pm(*dims: object, partial: bool = False, mesh: DeviceMesh = mesh,
               a: str = a) -> sw.NamedMapping:
            return sw.NamedMapping(mesh, dims, unreduced={a} if partial else frozenset())

        x, y, v = data(4, 6) / 3, data(4, 6).flip(0) / 5 + 1, data(6) / 4
        cases = [
            (operator.add, [(x, pm(a, None)), (y, pm(None, a))]),
            (operator.sub, [(x, pm(None, None, partial=True)), (y, pm(None, None))]),
            (operator.mul, [(x, pm(None, a)), (v, pm(None))]),
            (lambda p, q: (p * 3.0 - q).relu() / q, [(x, pm(None, None, partial=True)),
                                                     (y, pm(a, None))]),
            (lambda p, q: p @ q.T, [(x, pm(None, a)), (y, pm(None, a))]),
            (lambda p, q: p.T @ q, [(x, pm(a, None)), (y, pm(None, None))]),
            (lambda p: p.sum(0) * p.amax(0), [(x, pm(a, None))]),
            (lambda p: p.mean(1, keepdim=True) + p.softmax(1), [(x, pm(a, None))]),
            (lambda p: p.reshape(2, 12)[:, 1:5].exp(), [(x, pm(None, a))]),
            ((lambda p, q: sw.cat([p, q], 0).tanh(), lambda p, q: torch.cat([p, q], 0).tanh()),
             [(x, pm(None, a)), (y, pm(a, None))]),
            ((lambda p, q: sw.einsum("ij,ij->i", p, q),
              lambda p, q: torch.einsum("ij,ij->i", p, q)), [(x, pm(a, None)), (y, pm(None, a))]),
        ]
        for fns, inputs in cases:
            fn, ref_fn = fns if isinstance(fns, tuple) else (fns, fns)
            ts = [sw.tensor(val, sharding=s, requires_grad=True) for val, s in inputs]
            refs = [val.clone().requires_grad_(True) for val, _ in inputs]
            out, expect = fn(*ts), ref_fn(*refs)
            assert torch.allclose(out.to_torch(), expect, atol=1e-5), (fn, out, expect)
            weight = data(*expect.shape) / 7
            (out.to_torch() * weight).sum().backward()
            (expect * weight).sum().backward()
            for t, r in zip(ts, refs):
                assert t.grad is not None and r.grad is not None
                assert torch.allclose(t.grad.to_torch(), r.grad, atol=1e-5), (fn, axis)


BODIES.append("body_compute_grads")


def body_non_mesh_order(n: int) -> None:
    """Dims split over mesh axes in non-mesh order: torch orders group members by
    rank, shardwise by mesh coordinate; the values must not care."""
    if n != 4:
        return
    from shardwise import NamedMapping

    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    x = data(9, 6)
    specs = [(("tp", "dp"), None), (None, ("tp", "dp")), (("dp", "tp"), None), ("tp", "dp"),
             ("dp", "tp"), (None, None)]
    for src in specs:
        t = sw.tensor(x, sharding=NamedMapping(mesh, src))
        for dst in specs:
            out = sw.shard(t, dim_specs=NamedMapping(mesh, dst))
            assert torch.equal(out.to_torch(), x), (src, dst)
        p = sw.tensor(x, sharding=NamedMapping(mesh, (None, None), unreduced={"dp", "tp"}))
        rs = sw.shard(p, dim_specs=NamedMapping(mesh, src))
        assert torch.allclose(rs.to_torch(), x), src


BODIES.append("body_non_mesh_order")


def body_reduce_dtypes(n: int) -> None:
    """Integer reductions are exact (both runtimes reduce in their own order); an
    integer average is refused with the same error on both."""
    from shardwise.sharding import ShardingError

    mesh = DeviceMesh.cpu((n,), ("x",))
    terms = [torch.arange(30, dtype=torch.int64).reshape(10, 3) * (k + 1) for k in range(n)]
    p = sw.from_local(terms, PlacementMapping(mesh, [Partial()]), shape=(10, 3))
    total = sum(terms[1:], terms[0])
    rs = sw.reduce_scatter(p, 0)
    assert rs.dtype == torch.int64
    assert torch.equal(rs.to_torch(), total)
    assert torch.equal(sw.reduce_scatter(p, 1).to_torch(), total)  # 3 columns over n pieces
    assert torch.equal(sw.all_reduce(p).to_torch(), total)
    hi = sw.from_local(terms, PlacementMapping(mesh, [Partial("max")]), shape=(10, 3))
    assert torch.equal(sw.reduce_scatter(hi, 0).to_torch(), terms[-1])
    for fn in (lambda: sw.reduce_scatter(p, 0, reduce_op="avg"),
               lambda: sw.all_reduce(p, reduce_op="avg")):
        try:
            fn()
        except ShardingError as err:
            assert "integer dtype" in str(err), err
        else:
            raise AssertionError("an integer average must be refused")


BODIES.append("body_reduce_dtypes")


def body_small_all_reduce_wire(n: int) -> None:
    """Small all_reduces ride in the control message, copied in and out as bytes when
    the message has their dtype, through numpy otherwise (a float64 message carrying
    float32 data, a transposed block, a mean): every value equals torch's sum of the
    blocks (integer-valued floats: exact in any order)."""
    mesh = DeviceMesh.cpu((n,), ("x",))
    mine = [_me(mesh)] if _is_dist() else list(range(n))

    def terms(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
        return [torch.randint(-50, 50, shape, generator=torch.Generator().manual_seed(
            seed * 31 + k)).to(dtype) for k in range(n)]

    for step in range(4):  # the history learns each kind; later steps fold every call
        for shape, dtype, op, transposed in (((8, 8), torch.float32, "sum", False),
                                             ((8, 8), torch.float32, "sum", False),
                                             ((5,), torch.float64, "sum", False),
                                             ((6, 4), torch.float32, "sum", True),
                                             ((6, 4), torch.float32, "avg", False)):
            blocks = terms(shape, dtype, step)
            local = [b.t() if transposed else b for b in blocks]
            p = sw.from_local([b if k in mine else None for k, b in enumerate(local)],
                              PlacementMapping(mesh, [Partial()]), shape=tuple(local[0].shape))
            before = [b.clone() for b in local]
            out = sw.all_reduce(p, reduce_op=op)
            want = sum(local[1:], local[0])
            if op == "avg":
                want = want / n
            for k in mine:
                got = out.shards[k]
                assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape)
                assert torch.equal(got, want), (step, shape, dtype, op, got, want)
                assert torch.equal(local[k], before[k]), "the input was changed"


BODIES.append("body_small_all_reduce_wire")


def body_ppermute_grad(n: int) -> None:
    """Gradient (reverse and forward mode) of a ring ppermute is the inverse ring."""
    mesh = DeviceMesh.cpu((n,), ("x",))
    y = data(2 * n, 3)
    ring = [(i, (i + 1) % n) for i in range(n)]
    w = sw.tensor(y, sharding=PlacementMapping(mesh, [Sharded(0)]), requires_grad=True)
    moved = sw.ppermute(w, ring)
    weight = data(2 * n, 3) + 10
    (moved.to_torch() * weight).sum().backward()
    assert w.grad is not None
    # d/dy of sum(roll(y) * weight) = the weight rolled back: block i gets block i+1's weight
    want = torch.cat([weight[2 * ((i + 1) % n): 2 * ((i + 1) % n) + 2] for i in range(n)])
    assert torch.equal(w.grad.to_torch(), want)
    plain = sw.tensor(y, sharding=PlacementMapping(mesh, [Sharded(0)]))
    tangent = sw.tensor(weight, sharding=PlacementMapping(mesh, [Sharded(0)]))
    out, tan = sw.jvp(lambda t: sw.ppermute(t, ring), (plain,), (tangent,))
    assert torch.equal(tan.to_torch(), sw.ppermute(tangent, ring).to_torch())
    assert torch.equal(out.to_torch(), sw.ppermute(plain, ring).to_torch())


BODIES.append("body_ppermute_grad")


def body_reorder_within_dim(n: int) -> None:
    """A dim split over the same axes in another order is one permute step; values,
    gradients and tangents match the identity."""
    if n != 4:
        return
    from shardwise import NamedMapping

    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    x = data(8, 3)
    src = NamedMapping(mesh, (("dp", "tp"), None))
    dst = NamedMapping(mesh, (("tp", "dp"), None))
    t = sw.tensor(x, sharding=src, requires_grad=True)
    assert [s.kind for s in sw.plan(t, dst).steps] == ["permute"]
    out = sw.shard(t, dim_specs=dst)
    assert torch.equal(out.to_torch(), x)
    want = sw.tensor(x, sharding=dst)
    for k in range(4):
        if want.shards[k] is not None:
            assert torch.equal(out.shards[k], want.shards[k]), k
    weight = data(8, 3) + 5
    (out.to_torch() * weight).sum().backward()
    assert t.grad is not None and torch.equal(t.grad.to_torch(), weight)
    plain = sw.tensor(x, sharding=src)
    tangent = sw.tensor(weight, sharding=src)
    _, tan = sw.jvp(lambda v: sw.shard(v, dim_specs=dst), (plain,), (tangent,))
    assert torch.equal(tan.to_torch(), weight)
    # dims trading axes: all_to_all, permute, all_to_all (no gather)
    y = data(8, 12)
    for a, b in [(("dp", "tp"), ("tp", "dp")), (("dp", "tp"), (("tp", "dp"), None)),
                 (("tp", "dp"), ("dp", "tp"))]:
        t2 = sw.tensor(y, sharding=NamedMapping(mesh, a), requires_grad=True)
        target = NamedMapping(mesh, b)
        kinds = [s.kind for s in sw.plan(t2, target).steps]
        assert "all_gather" not in kinds and "permute" in kinds, kinds
        moved = sw.shard(t2, dim_specs=target)
        assert torch.equal(moved.to_torch(), y), (a, b)
        w2 = data(8, 12) - 2
        (moved.to_torch() * w2).sum().backward()
        assert t2.grad is not None and torch.equal(t2.grad.to_torch(), w2), (a, b)


BODIES.append("body_reorder_within_dim")


def body_permuted_devices(n: int) -> None:
    """A mesh whose devices are not in rank order: every collective keeps the mesh
    order (torch orders a group's members by rank), uneven sizes included."""
    from shardwise.sharding.devices import CPU

    order = [(k * 3 + 1) % n for k in range(n)] if n == 4 else list(reversed(range(n)))
    mesh = DeviceMesh(tuple(CPU(i) for i in order), (n,), ("x",))

    def pm(p: object) -> PlacementMapping:
        return PlacementMapping(mesh, [p])

    for shape in [(8, 6), (7, 5)]:
        x = data(*shape)
        s0 = sw.tensor(x, sharding=pm(Sharded(0)))
        assert torch.equal(sw.all_gather(s0).to_torch(), x), shape
        assert torch.equal(sw.all_to_all(s0, 1, 0).to_torch(), x), shape
        terms = [data(*shape) * (k + 1) for k in range(n)]
        p = sw.from_local(terms, pm(Partial()), shape=shape)
        total = sum(terms[1:], terms[0])
        assert torch.allclose(sw.reduce_scatter(p, 0).to_torch(), total), shape
        assert torch.allclose(sw.all_reduce(p).to_torch(), total), shape
        w = sw.tensor(x, sharding=pm(Sharded(1)), requires_grad=True)
        (sw.all_gather(w).to_torch() * (x + 1)).sum().backward()
        assert w.grad is not None and torch.equal(w.grad.to_torch(), x + 1), shape


BODIES.append("body_permuted_devices")


def body_demo_parity(n: int) -> None:
    """The demo script's training matches single-device torch on both runtimes."""
    from shardwise.cli import demo

    shape = (2, n // 2) if n % 2 == 0 and n > 1 else (1, n)
    assert demo.run(demo.Config(steps=10), shape, show=False) == 0


BODIES.append("body_demo_parity")


def _owned(mesh: DeviceMesh) -> list[int]:
    """The flat mesh indices whose local values this process holds."""
    return [_me(mesh)] if _is_dist() else list(range(mesh.num_devices))


REFERENCE = {"sum": lambda s: s.sum(0), "avg": lambda s: s.mean(0), "max": lambda s: s.amax(0),
             "min": lambda s: s.amin(0), "prod": lambda s: s.prod(0)}


def body_reduce_op_grads(n: int) -> None:
    """Gradients through all_reduce / reduce_scatter of a Partial(op), for every op,
    equal single-device torch's (each device's term is a leaf; the reference
    reduces the stacked terms). Terms are distinct and nonzero: no ties, no 0/0."""
    for mesh in meshes_for(n):
        size = mesh.num_devices  # Partial over every mesh axis: one term per device
        for op in OPS:
            pm = PlacementMapping(mesh, [Partial(op)] * mesh.ndim)
            coords = list(range(size))
            terms = [(data(2 * size, 3) + 0.5) * (1 + 0.3 * c) for c in range(size)]
            weight = data(2 * size, 3) / 3 + 1
            refs = [t.clone().requires_grad_(True) for t in terms]
            (REFERENCE[op](torch.stack(refs)) * weight).sum().backward()
            for fn in (sw.all_reduce, lambda p: sw.reduce_scatter(p, 0)):
                owned = _owned(mesh)
                leaves = [terms[coords[k]].clone().requires_grad_(True) if k in owned else None
                          for k in range(mesh.num_devices)]
                p = sw.from_local(leaves, pm, shape=(2 * size, 3))
                out = fn(p).to_torch()
                assert torch.allclose(out, REFERENCE[op](torch.stack(terms)), atol=1e-5), op
                (out * weight).sum().backward()
                for k in owned:
                    got, want = leaves[k].grad, refs[coords[k]].grad  # type: ignore[union-attr]
                    assert got is not None and want is not None, (op, k)
                    assert torch.allclose(got, want, atol=1e-5), (mesh, op, k, got, want)


def body_partial_op_grads(n: int) -> None:
    """Replicated -> Partial(op) -> Replicated (and -> Sharded) is the identity for
    every op, gradient included; all_reduce(op) of a replicated value is op over n
    equal copies (x * n for sum, x ** n for prod, x otherwise), gradient too."""
    mesh = DeviceMesh.cpu((n,), ("x",))
    x = data(4, 3) / 4 + 1.25  # nonzero, so prod's gradient is finite
    rep = PlacementMapping(mesh, [Replicated()])
    for op in OPS:
        part = PlacementMapping(mesh, [Partial(op)])
        _check_grad(lambda t, part=part: sw.shard(t, dim_specs=part), x, rep)
        _check_grad(lambda t, part=part: sw.shard(sw.shard(t, dim_specs=part), dim_specs=rep),
                    x, rep)
        _check_grad(lambda t, part=part: sw.shard(sw.shard(t, dim_specs=part),
                                                  dim_specs=PlacementMapping(mesh, [Sharded(0)])),
                    x, rep)
        w = sw.tensor(x, sharding=rep, requires_grad=True)
        weight = data(4, 3) + 4
        out = sw.all_reduce(w, reduce_op=op).to_torch()
        ref = x.clone().requires_grad_(True)
        want = {"sum": ref * n, "prod": ref ** n}.get(op, ref)
        assert torch.allclose(out, want, rtol=1e-5), op
        (out * weight).sum().backward()
        (want * weight).sum().backward()
        assert w.grad is not None and ref.grad is not None
        assert torch.allclose(w.grad.to_torch(), ref.grad, rtol=1e-5), (op, w.grad, ref.grad)


def body_ppermute_grads_not_self_inverse(n: int) -> None:
    """ppermute gradients for permutations that are not their own inverse (a single
    pair, a reversed ring, a 3-cycle), against the same move done on the torch
    blocks; also along one axis of a 2x2 mesh."""
    y = data(3 * n, 2) + 0.5
    weight = data(3 * n, 2) / 5 + 2
    perms = [[(0, 1)], [(i, (i - 1) % n) for i in range(n)]]
    if n >= 3:
        perms.append([(0, 2), (2, 1), (1, 0)])
    mesh = DeviceMesh.cpu((n,), ("x",))
    for perm in perms:
        _check_ppermute(mesh, y, weight, perm, None)
    if n == 4:
        _check_ppermute(DeviceMesh.cpu((2, 2), ("dp", "tp")), y, weight, [(0, 1)], "tp")
        _check_ppermute(DeviceMesh.cpu((2, 2), ("dp", "tp")), y, weight, [(0, 1)], "dp")


def _check_ppermute(mesh: DeviceMesh, y: torch.Tensor, weight: torch.Tensor,
                    perm: list[tuple[int, int]], axis_name: str | None) -> None:
    n = mesh.num_devices
    rows = y.shape[0] // n
    pm = sw.NamedMapping(mesh, (mesh.axis_names, None))
    w = sw.tensor(y, sharding=pm, requires_grad=True)
    moved = sw.ppermute(w, perm, axis_name=axis_name).to_torch()
    ref = y.clone().requires_grad_(True)
    blocks = list(ref.split(rows))
    out_blocks = [torch.zeros_like(b) for b in blocks]
    for k in range(n):
        coord = list(mesh.coord_of(k))
        a = None if axis_name is None else mesh.axis_index(axis_name)
        for src, dst in perm:
            if a is None and k == dst:
                out_blocks[k] = blocks[src]
            elif a is not None and coord[a] == dst:
                coord[a] = src
                out_blocks[k] = blocks[mesh.index_of(coord)]
    want = torch.cat(out_blocks)
    assert torch.equal(moved, want), (perm, axis_name)
    (moved * weight).sum().backward()
    (want * weight).sum().backward()
    assert w.grad is not None and ref.grad is not None
    assert torch.equal(w.grad.to_torch(), ref.grad), (perm, axis_name, w.grad, ref.grad)


BODIES += ["body_reduce_op_grads", "body_partial_op_grads", "body_ppermute_grads_not_self_inverse"]


def body_reduce_dtype_errors(n: int) -> None:
    """A reduce op the dtype cannot do is the same ShardingTypeError on every runtime
    (before any collective runs, so no rank is left waiting); the others still work."""
    from shardwise.sharding.errors import ShardingTypeError

    mesh = DeviceMesh.cpu((n,), ("x",))
    for dtype, op, needle in [(torch.complex64, "max", "no order"),
                              (torch.complex64, "min", "no order"),
                              (torch.int64, "avg", "not an integer")]:
        p = sw.tensor(torch.ones(2 * n, dtype=dtype), sharding=PlacementMapping(mesh,
                                                                                [Partial(op)]))
        for fn in (sw.all_reduce, lambda t: sw.reduce_scatter(t, 0)):
            try:
                fn(p)
            except ShardingTypeError as err:
                assert str(dtype) in str(err) and needle in str(err), err
            else:
                raise AssertionError(f"{op} of {dtype} was accepted")
    ok = sw.tensor(torch.ones(2 * n, dtype=torch.complex64),
                   sharding=PlacementMapping(mesh, [Partial("sum")]))
    assert torch.equal(sw.all_reduce(ok).to_torch(), torch.ones(2 * n, dtype=torch.complex64))


BODIES.append("body_reduce_dtype_errors")


def body_grad_hooks(n: int) -> None:
    """Autograd hooks on a Tensor (on the whole value or the blocks in one process, on
    each process's block under torch.distributed): a hook sees torch's gradient, one
    that returns a new gradient changes the leaf's as torch's does, a post-accumulate
    hook runs once per backward."""
    mesh = DeviceMesh.cpu((n,), ("x",))
    for place in (Sharded(0), Replicated()):
        x = sw.tensor(data(2 * n, 3) / 5, sharding=PlacementMapping(mesh, [place])
                      ).requires_grad_()   # (one process: the whole is the leaf)
        ref = (data(2 * n, 3) / 5).requires_grad_(True)
        seen: list[torch.Tensor] = []
        want: list[torch.Tensor] = []
        done: list[int] = []
        y, y_ref = x.tanh(), ref.tanh()
        y.register_hook(lambda g, seen=seen: seen.append(g.to_torch()))
        y_ref.register_hook(lambda g, want=want: want.append(g.clone()))
        x.register_hook(lambda g: g * 2 + 1)   # (a leaf: autograd on the whole or one block)
        ref.register_hook(lambda g: g * 2 + 1)
        x.register_post_accumulate_grad_hook(lambda t, done=done: done.append(1))
        (y * y).sum().backward()
        (y_ref * y_ref).sum().backward()
        assert len(seen) == 1 and torch.allclose(seen[0], want[0], atol=1e-6), place
        assert done == [1], done
        assert x.grad is not None and ref.grad is not None
        assert torch.allclose(x.grad.to_torch(), ref.grad, atol=1e-6), place


BODIES.append("body_grad_hooks")
