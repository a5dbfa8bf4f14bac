"""shard_map test bodies shared by both runtimes: each takes the number of devices ``n``.

Run directly, they use a simulated mesh of ``n`` virtual CPUs (fn runs in ``n``
threads); run on every rank of an ``n``-process Gloo group (``harness.py``), the
same code builds meshes over the processes and each process runs fn on its own
block. Each run checks the per-device values it sees (all of them simulated,
its own under Gloo) against a pure-torch reference, and gradients against
single-device autograd of the equivalent global function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import shardwise as sw
from shardwise import DeviceMesh, NamedMapping, Partial, PlacementMapping, Sharded, lax
from shardwise.debug import CommCounter
from tests.helpers.meshes import meshes_for

Fn = Callable[..., Any]


def data(*shape: int, seed: int = 0) -> torch.Tensor:
    """Distinct values (no ties for pmax/pmin), the same on every process."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def axis_choices(mesh: DeviceMesh) -> list[Any]:
    names = mesh.axis_names
    out: list[Any] = list(names)
    if len(names) > 1:
        out += [tuple(names), tuple(reversed(names))]
    return out


def members(mesh: DeviceMesh, axes: Any, k: int) -> list[int]:
    """Reference: the devices that differ from ``k`` only along ``axes``, in axis
    order (row-major over the names as given)."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    idx = [mesh.axis_names.index(a) for a in names]
    me = mesh.coord_of(k)
    same = [j for j in range(mesh.num_devices)
            if all(c == me[a] for a, c in enumerate(mesh.coord_of(j)) if a not in idx)]
    return sorted(same, key=lambda j: tuple(mesh.coord_of(j)[a] for a in idx))


def per_device(mesh: DeviceMesh, x: torch.Tensor, body: Fn) -> dict[int, torch.Tensor]:
    """``body(block)`` on every device, ``x`` split over all mesh axes along dim 0
    (device k gets piece k); returns ``{device: result}`` for the devices seen here."""
    seen: dict[int, torch.Tensor] = {}
    names = mesh.axis_names

    def fn(a: torch.Tensor) -> torch.Tensor:
        seen[lax.axis_index(names)] = body(a)
        return a

    out = sw.shard_map(fn, mesh, in_specs=((names,),), out_specs=(names,))(x)
    assert torch.equal(out.to_torch(), x)
    assert seen, "fn did not run on any device of this process"
    return seen


def check_collective(mesh: DeviceMesh, x: torch.Tensor, body: Fn,
                     ref: Callable[[list[torch.Tensor], int], torch.Tensor], axes: Any,
                     what: str) -> None:
    blocks = list(x.tensor_split(mesh.num_devices))
    for k, got in per_device(mesh, x, body).items():
        group = members(mesh, axes, k)
        want = ref([blocks[m] for m in group], group.index(k))
        assert got.shape == want.shape, (what, axes, k, got.shape, want.shape)
        assert torch.allclose(got, want), (what, axes, k, got, want)


def body_collective_values(n: int) -> None:
    """Every lax collective, by single axis and by tuples (in and out of mesh order)."""
    for mesh in meshes_for(n):
        for axes in axis_choices(mesh):
            g = lax_size(mesh, axes)
            x = data(3 * mesh.num_devices, 4)

            def check(body: Fn, ref: Callable[[list[torch.Tensor], int], torch.Tensor],
                      what: str, x: torch.Tensor = x, axes: Any = axes,
                      mesh: DeviceMesh = mesh) -> None:
                check_collective(mesh, x, body, ref, axes, what)

            check(lambda a, ax=axes: lax.psum(a, ax), lambda v, p: sum(v), "psum")
            check(lambda a, ax=axes: lax.pmean(a, ax), lambda v, p: sum(v) / len(v), "pmean")
            check(lambda a, ax=axes: lax.pmax(a, ax), lambda v, p: torch.stack(v).amax(0),
                  "pmax")
            check(lambda a, ax=axes: lax.pmin(a, ax), lambda v, p: torch.stack(v).amin(0),
                  "pmin")
            for axis in (0, 1, -1):
                check(lambda a, ax=axes, d=axis: lax.all_gather(a, ax, axis=d, tiled=True),
                      lambda v, p, d=axis: torch.cat(v, d), "all_gather tiled")
                check(lambda a, ax=axes, d=axis: lax.all_gather(a, ax, axis=d),
                      lambda v, p, d=axis: torch.stack(v, d), "all_gather")
            for dim in (0, 1):
                check(lambda a, ax=axes, d=dim: lax.psum_scatter(a, ax, scatter_dimension=d),
                      lambda v, p, d=dim: sum(v).tensor_split(len(v), d)[p],
                      "psum_scatter tiled (uneven)")
            check(lambda a, ax=axes, g=g: lax.psum_scatter(a[:, :g], ax, scatter_dimension=1,
                                                           tiled=False),
                  lambda v, p: sum(v)[:, p], "psum_scatter")
            ring = [(i, (i + 1) % g) for i in range(g)]
            check(lambda a, ax=axes, r=ring: lax.ppermute(a, ax, r),
                  lambda v, p: v[(p - 1) % len(v)], "ppermute ring")
            check(lambda a, ax=axes, g=g: lax.ppermute(a, ax, [(0, g - 1)]),
                  lambda v, p: v[0] if p == len(v) - 1 else torch.zeros_like(v[p]),
                  "ppermute one pair")
            for split, concat in ((1, 0), (0, 1), (0, 0), (1, 1)):
                check(lambda a, ax=axes, s=split, c=concat: lax.all_to_all(a, ax, s, c),
                      lambda v, p, s=split, c=concat: torch.cat(
                          [b.tensor_split(len(v), s)[p] for b in v], c),
                      f"all_to_all tiled {split}->{concat}")
                check(lambda a, ax=axes, s=split, c=concat, g=g: lax.all_to_all(
                          a.repeat(2, 2).narrow(s, 0, g), ax, s, c, tiled=False),
                      lambda v, p, s=split, c=concat, g=g: torch.stack(
                          [b.repeat(2, 2).narrow(s, 0, g).select(s, p) for b in v], c),
                      f"all_to_all {split}->{concat}")
            check(lambda a, ax=axes: a * lax.axis_index(ax) + lax.axis_size(ax),
                  lambda v, p: v[p] * p + len(v), "axis_index")


def lax_size(mesh: DeviceMesh, axes: Any) -> int:
    names = (axes,) if isinstance(axes, str) else axes
    size = 1
    for a in names:
        size *= mesh.axis_size(a)
    return size


def body_uneven(n: int) -> None:
    """5 rows over n devices: blocks follow the split rule in and out, and uneven
    blocks travel through all_gather, all_to_all and ppermute."""
    mesh = DeviceMesh.cpu((n,), ("x",))
    x = data(5, 3)
    sizes = [t.shape[0] for t in x.tensor_split(n)]

    def fn(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        k = lax.axis_index("x")
        assert a.shape == (sizes[k], 3), (k, a.shape)
        full = lax.all_gather(a, "x", tiled=True)
        cols = lax.all_to_all(a, "x", split_axis=1, concat_axis=0)
        moved = lax.ppermute(a, "x", [(i, (i + 1) % n) for i in range(n)])
        assert moved.shape[0] == sizes[(k - 1) % n]
        return a * 2, full, cols, lax.psum(a.sum(0), "x")

    doubled, full, cols, total = sw.shard_map(
        fn, mesh, in_specs=(("x",),), out_specs=(("x",), None, (None, "x"), None))(x)
    assert doubled.shape == (5, 3)
    assert torch.allclose(doubled.to_torch(), 2 * x)
    assert torch.allclose(full.to_torch(), x)
    assert torch.allclose(cols.to_torch(), x)
    assert torch.allclose(total.to_torch(), x.sum(0))


def check_grads(mesh: DeviceMesh, fn: Fn, in_specs: Any, out_specs: Any, ref: Fn,
                *xs: torch.Tensor) -> None:
    """Values and gradients (torch leaves and shardwise Tensors) against ``ref``."""
    leaves = [x.clone().requires_grad_() for x in xs]
    out = sw.shard_map(fn, mesh, in_specs, out_specs)(*leaves)
    refs = [x.clone().requires_grad_() for x in xs]
    want = ref(*refs)
    coef = data(*want.shape, seed=1)
    got = out.to_torch()
    assert got.shape == want.shape and torch.allclose(got, want), (got, want)
    (got * coef).sum().backward()
    (want * coef).sum().backward()
    for leaf, r in zip(leaves, refs):
        assert leaf.grad is not None and torch.allclose(leaf.grad, r.grad), (leaf.grad, r.grad)
    ts = [sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0)] * mesh.ndim),
                    requires_grad=True) for x in xs]
    (sw.shard_map(fn, mesh, in_specs, out_specs)(*ts).to_torch() * coef).sum().backward()
    for t, r in zip(ts, refs):
        assert t.grad is not None and t.grad.placements == t.placements
        assert torch.allclose(t.grad.to_torch(), r.grad), (t.grad.to_torch(), r.grad)


def body_gradients(n: int) -> None:
    """Gradients through each collective equal single-device autograd."""
    mesh = DeviceMesh.cpu((n,), ("x",))
    ring = [(i, (i + 1) % n) for i in range(n)]
    scale = torch.arange(1, n + 1, dtype=torch.float64).repeat_interleave(2)[:, None]
    w = data(3, 2, seed=2)
    cases: list[tuple[Fn, Any, Any, Fn, tuple[torch.Tensor, ...]]] = [
        # data parallel: rows over x (uneven for n=4), weights replicated, psum
        (lambda a, w: lax.psum((a @ w).sum(0), "x"), (("x",), None), None,
         lambda a, w: (a @ w).sum(0), (data(5, 3), w)),
        (lambda a, w: lax.pmean(a @ w, "x"), (("x", None), None), None,
         lambda a, w: (a.reshape(n, 2, 3) @ w).mean(0), (data(2 * n, 3), w)),
        # tensor parallel: contraction dim over x, psum
        (lambda a, b: lax.psum(a @ b, "x"), ((None, "x"), ("x",)), None,
         lambda a, b: a @ b, (data(4, 3 * n), data(3 * n, 2, seed=3))),
        # all_gather <-> psum_scatter, replicated and sharded outputs
        (lambda a, w: (lax.all_gather(a, "x", tiled=True) ** 2) @ w, (("x",), None), None,
         lambda a, w: (a ** 2) @ w, (data(5, 3), w)),
        (lambda a, w: (lax.all_gather(a, "x", tiled=True) @ w).narrow(
            0, 2 * lax.axis_index("x"), 2) * (lax.axis_index("x") + 1), (("x",), None),
         ("x",), lambda a, w: (a @ w) * scale, (data(2 * n, 3), w)),
        (lambda a, w: lax.all_gather(a, "x").sum(0) * w.sum(), (("x",), None), None,
         lambda a, w: a.reshape(n, 2, 3).sum(0) * w.sum(), (data(2 * n, 3), w)),
        # psum_scatter <-> all_gather
        (lambda a, b: lax.psum_scatter(a @ b, "x", scatter_dimension=1), ((None, "x"), ("x",)),
         (None, "x"), lambda a, b: a @ b, (data(4, 3 * n), data(3 * n, 5, seed=3))),
        # ppermute <-> inverse ppermute
        (lambda a: lax.ppermute(a, "x", ring) * (lax.axis_index("x") + 1), (("x",),), ("x",),
         lambda a: torch.roll(a, 2, 0) * scale, (data(2 * n, 3),)),
        # all_to_all <-> inverse all_to_all (uneven both ways)
        (lambda a: lax.all_to_all(a, "x", 1, 0) ** 2, (("x",),), (None, "x"),
         lambda a: a ** 2, (data(5, 7),)),
        # pmax: the gradient goes to the device holding the max
        (lambda a: lax.pmax(a, "x") * 3, (("x",),), None,
         lambda a: a.reshape(n, 2, 3).amax(0) * 3, (data(2 * n, 3),)),
        # a replicated input used by every device
        (lambda v: lax.psum(v * (lax.axis_index("x") + 1), "x"), (None,), None,
         lambda v: v * (n * (n + 1) / 2), (data(3, 2),)),
    ]
    if n == 4:
        m2 = DeviceMesh.cpu((2, 2), ("dp", "tp"))
        cases2: list[tuple[Fn, Any, Any, Fn, tuple[torch.Tensor, ...]]] = [
            (lambda a, b: lax.psum(a @ b, "tp"), (("dp", "tp"), ("tp",)), ("dp",),
             lambda a, b: a @ b, (data(4, 6), data(6, 3, seed=3))),
            (lambda a: lax.all_gather(a, ("tp", "dp"), tiled=True) * 2, ((("dp", "tp"),),),
             None, lambda a: a.reshape(2, 2, 2, 3).transpose(0, 1).reshape(8, 3) * 2,
             (data(8, 3),)),
            (lambda a: lax.psum(a, ("dp", "tp")), ((("dp", "tp"),),), None,
             lambda a: a.reshape(4, 2, 3).sum(0), (data(8, 3),)),
        ]
        for fn, ins, outs, ref, xs in cases2:
            check_grads(m2, fn, ins, outs, ref, *xs)
    for fn, ins, outs, ref, xs in cases:
        check_grads(mesh, fn, ins, outs, ref, *xs)


def body_outputs(n: int) -> None:
    """Several outputs, every spec form, Partial outputs, equality checks."""
    mesh = DeviceMesh.cpu((n,), ("x",))
    x = data(2 * n, 3)

    def fn(a: torch.Tensor) -> list[torch.Tensor]:
        return [a, a.sum(0), lax.psum(a.sum(0), "x")]

    a, part, total = sw.shard_map(
        fn, mesh, in_specs=[PlacementMapping(mesh, [Sharded(0)])],
        out_specs=[NamedMapping(mesh, ("x",)), PlacementMapping(mesh, [Partial()]), ()])(x)
    assert torch.equal(a.to_torch(), x)
    assert part.placements == (Partial(),)
    assert torch.allclose(part.to_torch(), x.sum(0))
    assert torch.allclose(total.to_torch(), x.sum(0))
    # one sharding-form spec applies to every output; data as input
    _, two = sw.shard_map(lambda b: (b, b + 1), mesh, in_specs=(("x",),),
                            out_specs=NamedMapping(mesh, ("x",)))(x.tolist())
    assert torch.allclose(two.to_torch().double(), x + 1)
    # check_replicated: equal values pass, different values raise (on every process)
    ok = sw.shard_map(lambda b: lax.psum(b, "x"), mesh, in_specs=(("x",),), out_specs=None,
                      check_replicated=True)(x)
    assert ok.shape == (2, 3)
    try:
        sw.shard_map(lambda b: b, mesh, in_specs=(("x",),), out_specs=None,
                     check_replicated=True)(x)
    except sw.ShardingError as err:
        assert "replicated" in str(err), err
    else:
        raise AssertionError("different replicas passed check_replicated")
    # blocks that break the split rule are refused on every process
    try:
        sw.shard_map(lambda b: b[: lax.axis_index("x") + 1], mesh, in_specs=(None,),
                     out_specs=("x",))(x)
    except sw.ShardingError as err:
        assert "split rule" in str(err), err
    else:
        raise AssertionError("blocks 1, 2, ... rows were accepted as a split")


def body_errors(n: int) -> None:
    """Errors raised the same way on every process."""
    try:
        lax.psum(torch.ones(2), "x")
    except sw.ShardingError as err:
        assert "outside shard_map" in str(err), err
    else:
        raise AssertionError("lax.psum outside shard_map did not raise")
    mesh = DeviceMesh.cpu((n,), ("x",))
    try:
        sw.shard_map(lambda a: lax.psum(a, "y"), mesh, in_specs=(None,), out_specs=None)(
            torch.ones(2))
    except sw.ShardingError as err:
        assert "unknown mesh axis 'y'" in str(err), err
    else:
        raise AssertionError("unknown axis accepted")


def body_forward_mode(n: int) -> None:
    """Tangents go through the collectives (shardwise.jvp)."""
    mesh = DeviceMesh.cpu((n,), ("x",))
    x, t = data(2 * n, 3), data(2 * n, 3, seed=5)
    f = sw.shard_map(lambda a: lax.all_gather(lax.psum(a * a, "x"), "x", tiled=True), mesh,
                     in_specs=(("x",),), out_specs=None)
    xs = sw.tensor(x, sharding=PlacementMapping(mesh, [Sharded(0)]))
    out, tan = sw.jvp(f, (xs,), (t,))
    blocks = (x * x).reshape(n, 2, 3).sum(0)
    assert torch.allclose(out.to_torch(), blocks.repeat(n, 1))
    assert torch.allclose(tan.to_torch(), (2 * x * t).reshape(n, 2, 3).sum(0).repeat(n, 1))


BODIES = ["body_collective_values", "body_uneven", "body_gradients", "body_outputs",
          "body_errors", "body_forward_mode"]


def body_no_write_through(n: int) -> None:
    """fn writing to its input block (in place, through a view, after a collective,
    under autograd) is stopped before the write: the caller's torch tensor and
    shardwise Tensor are intact on every process. Writes to fn's own tensors pass."""
    mesh = DeviceMesh.cpu((n,), ("x",))
    x = data(2 * n, 3)
    writes: list[Fn] = [lambda a: a.mul_(0), lambda a: a[1:].zero_(),
                        lambda a: (lax.psum(a, "x"), a.copy_(torch.zeros_like(a)))[1],
                        lambda a: torch.mul(a.detach(), 0, out=a.detach())]
    for spec in [("x",), None]:
        for write in writes:
            caller = x.clone()
            t = sw.tensor(x.clone(), sharding=PlacementMapping(mesh, [Sharded(0)]))
            leaf = sw.tensor(x.clone(), sharding=PlacementMapping(mesh, [Sharded(0)]),
                             requires_grad=True)
            for arg in (caller, t, leaf):
                try:
                    sw.shard_map(write, mesh, in_specs=(spec,), out_specs=spec)(arg)
                except sw.ShardingError as err:
                    assert "about to write to argument 0" in str(err), err
                except RuntimeError as err:  # autograd may refuse first (grad leaf views)
                    assert arg is leaf and "inplace" in str(err).replace("-", ""), err
                else:
                    raise AssertionError(f"a write to an input block passed ({spec})")
            assert torch.equal(caller, x), spec
            assert torch.equal(t.to_torch(), x), spec
            assert torch.equal(leaf.to_torch(), x), spec

    def own(a: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(a)
        torch.mul(a, 2, out=out)
        s = lax.psum(out, "x")
        s.add_(1)
        return s

    got = sw.shard_map(own, mesh, in_specs=(("x",),), out_specs=None)(x)
    assert torch.allclose(got.to_torch(), (2 * x).reshape(n, 2, 3).sum(0) + 1)


BODIES.append("body_no_write_through")


def body_ragged(n: int) -> None:
    """lax.ragged_all_to_all: values, the transposed exchange as gradient, and the bytes
    each device sends to the others (a circulant matrix of sizes: the blocks follow the
    split rule both ways)."""
    mesh = DeviceMesh.cpu(n, "x")
    ring = [(k * k + 1) % 4 for k in range(n)]
    sizes = [[ring[(j - i) % n] for j in range(n)] for i in range(n)]
    per = sum(ring)
    x = data(n * per, 3, seed=1)

    def reference(v: torch.Tensor) -> torch.Tensor:  # device j: each i's piece j, in order
        return torch.cat([v[i * per + sum(sizes[i][:j]):][:sizes[i][j]] * (j + 1)
                          for j in range(n) for i in range(n)])

    def fn(a: torch.Tensor) -> torch.Tensor:
        return lax.ragged_all_to_all(a, "x", sizes) * (lax.axis_index("x") + 1)

    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    with CommCounter() as cc:
        y = sw.shard_map(fn, mesh, in_specs=(("x", None),), out_specs=("x", None))(xs)
    want = reference(xr)
    assert torch.allclose(y.to_torch(), want)
    (y * y).sum().backward()
    (want * want).sum().backward()
    assert torch.allclose(xs.grad, xr.grad)
    me = sw.distributed.process_index()  # 0 simulated: CommCounter counts device 0 there
    assert cc.counts == {"all_to_all": 1}
    assert cc.bytes["all_to_all"] == (per - sizes[me][me]) * 3 * 8


BODIES.append("body_ragged")
