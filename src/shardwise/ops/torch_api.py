"""torch functions on shardwise Tensors: the registry behind ``Tensor.__torch_function__``.

Every ``torch.*`` function, ``Tensor`` method or operator and ``torch.nn.functional``
op called with a shardwise Tensor arrives here as ``(func, args, kwargs)``. Importing
this module imports every family of handlers (each registers its own at import, right
above each handler) and then sets the fallback:

==================  ================================================================
``elementwise``     ``x + y``, ``torch.relu``, ``F.gelu``, ``torch.where``...
``conversions``     ``x.to(dtype)``, ``x.float()``, ``clone``, ``contiguous``, ``conj``
``factories``       ``torch.zeros_like``, ``x.new_zeros``, ``torch.randn_like``...
``inplace``         ``x.add_(y)``, ``x += y``, ``copy_``, ``zero_``, random fills
``foreach``         ``torch._foreach_*`` (the optimizers)
``shapes``          view, reshape, permute, expand, cat, stack, split, flip...
``views``           diagonals, unfold, scatters into views, splits, movedim, *_copy
``joins``           broadcast_to, atleast_*d, h/v/dstack, repeat, tile, meshgrid
``indexing``        ``x[...]``, ``torch.index_select``
``reductions``      sum, mean, amax, norms, var, max, topk, sort, cumsum, softmax
``nn``              linear, matmul, addmm, layer/rms norm, embedding, dropout, sdpa
``linalg``          batched ``torch.linalg``, norms over dims, cross, distances, diff...
``matmuls``         addmv and kin, dot, outer, tensordot, kron, grouped_mm, cdist...
``losses``          cross_entropy, nll_loss, the pointwise and per-sample losses
``layers``          conv, pools, interpolate, pad, batch/group/instance norm, grid_sample
``spectral``        ``torch.fft.*`` (the transformed dims whole)
``sampling``        bernoulli, normal, multinomial, feature/alpha dropouts, rrelu
``autograd``        ``torch.autograd.grad``, ``torch.autograd.backward``
==================  ================================================================

Invariants:
- Each call resolves to exactly one of: a registered handler (sharding propagation
  through :func:`shardwise.ops.execute.apply`, values equal to torch's on the global
  tensor), a metadata query answered by the wrapper itself, or the fallback.
- The fallback never gives a wrong value: an op without a rule runs on the gathered
  global operands and returns a Replicated result, warning once per op by name
  (:class:`ShardwiseFallbackWarning`); an in-place op without a rule raises, naming
  the op (writing into a gathered copy would be lost silently).
- torch.compile's graph breaks in shardwise programs are watched from here on
  (:mod:`shardwise.ops.graph_breaks`): listed by ``shardwise.debug``, raised in strict mode.
- ``out=`` (any op): the op runs without it, then its result is copied into ``out``
  (:func:`~shardwise.ops.registry.write_out`), as torch fills it.
- In-place ops write each distinct local buffer once (replicas share one buffer), so
  ``torch.optim`` updates a sharded parameter exactly as it would the global one.
- Plain torch tensors mixed with shardwise Tensors are treated as Replicated on the
  Tensor's mesh (every process must hold the same value), like JAX's numpy arrays.
- A torch function has one handler: the families register disjoint sets of functions
  (within a family a later registration may replace an earlier one on purpose:
  ``Tensor.__neg__`` is ``Tensor.neg``; ``copy_`` and ``zero_`` replace the generic
  in-place handler). A family imports the families it reads (``inplace`` reads
  ``elementwise``'s handlers), so the order of the imports below does not matter.
"""

from __future__ import annotations

from shardwise.ops import (
    autograd,
    conversions,
    elementwise,
    factories,
    foreach,
    graph_breaks,  # noqa: F401  (watches torch.compile's graph breaks: strict mode, debug)
    indexing,
    inplace,
    joins,
    layers,
    linalg,
    losses,
    nn,
    reductions,
    sampling,
    shapes,
    spectral,
    views,
)
from shardwise.ops import compiling as _compiling  # noqa: F401  (routes torch's backends)
from shardwise.ops.registry import ShardwiseFallbackWarning, fallback, register, write_out
from shardwise.tensors.tensor import FALLBACK, WRITE_OUT

__all__ = ["ShardwiseFallbackWarning", "install", "register"]

#: the handler families (the table in the module docstring)
FAMILIES = (elementwise, conversions, factories, inplace, foreach, shapes, indexing,
            reductions, nn, linalg, losses, layers, spectral, sampling, autograd, views,
            joins)


def install() -> None:
    """Set the fallback once the families have registered their handlers (idempotent;
    importing this module calls it)."""
    if not FALLBACK:
        FALLBACK.append(fallback)
    if not WRITE_OUT:
        WRITE_OUT.append(write_out)


install()
