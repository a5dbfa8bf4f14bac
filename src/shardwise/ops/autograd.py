"""torch's autograd entries on shardwise Tensors: ``torch.autograd.grad`` and
``torch.autograd.backward`` (``Tensor.backward`` calls the latter, as torch's does).

A shardwise Tensor is a wrapper with no autograd state of its own: torch records its
ops on the whole value it holds, else on its distinct blocks. So each Tensor among
the outputs, the inputs and the seed gradients is replaced by the torch tensors that
autograd ran on, torch's engine runs once over all of them, and the gradients come
back wrapped.

Invariants:
- Values are torch's: the engine differentiates the very tensors the forward
  recorded (the whole, or the blocks: views of a whole flow into it), with torch's
  retain_graph / create_graph; a plain torch tensor among outputs or inputs is passed
  through as it is.
- An output is differentiated through its reduced value (Partial axes reduced, as
  ``backward`` does); its seed gradient, a shardwise Tensor in any layout or plain
  data of its global shape (None for a scalar: ones), is laid out like that value.
- A gradient comes back in its input's layout (the Partial(SUM) axes Replicated, as
  ``.grad`` shows them);
  with ``create_graph=True`` it records its own graph, so a gradient penalty's
  backward works.
- ``allow_unused`` / ``materialize_grads`` are torch's, per input: an input none of
  whose autograd tensors got a gradient is unused (an error, None, or zeros in its
  layout); an input only some of whose blocks did gets zeros on the others (the
  value of a gradient that is zero there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardwise.ops.registry import register
from shardwise.sharding.errors import ShardingError
from shardwise.tensors.tensor import Tensor, as_layout_of

__all__ = ["backward", "grad"]

_UNUSED = ("One of the differentiated Tensors appears to not have been used in the graph "
           "({what}). Set allow_unused=True if this is the desired behavior.")


def _as_tuple(x: Any, n: int | None = None) -> tuple[Any, ...]:
    if x is None:
        return (None,) * (n or 0)
    if isinstance(x, torch.Tensor):
        return (x,)
    return tuple(x)


def _roots(outputs: Sequence[Any], seeds: Sequence[Any]
           ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The torch tensors autograd recorded for ``outputs`` and their seed gradients."""
    if len(seeds) != len(outputs):
        raise RuntimeError(f"grad can be implicitly created only for scalar outputs: got "
                           f"{len(seeds)} gradients for {len(outputs)} outputs.")
    outs: list[torch.Tensor] = []
    gs: list[torch.Tensor | None] = []
    for o, g in zip(outputs, seeds):
        if not isinstance(o, Tensor):  # plain torch: torch checks it, a shardwise seed
            outs.append(o)             # is gathered
            gs.append(g.to_torch() if isinstance(g, Tensor) else g)
            continue
        r = o.reduced()
        if g is None and r.requires_grad:
            if r.numel() != 1:
                raise RuntimeError(
                    f"grad can be implicitly created only for scalar outputs; {o!r} has "
                    "shape " f"{tuple(o.shape)}: pass its gradient (grad_outputs= / "
                    "gradient=, same global shape).")
            g = torch.ones((), dtype=o.dtype).expand(o.shape)
        seed = None if g is None else as_layout_of(g, r)
        buffers = r.held.buffers()
        if not any(b.requires_grad for b in buffers):
            buffers = buffers[:1]  # torch names it: "does not require grad"
        for i, b in enumerate(buffers):
            if b.requires_grad or len(buffers) == 1:
                outs.append(b)
                gs.append(None if seed is None else r.held.part(seed.held, i, r.dist_layout))
    return outs, gs


def _leaves(x: Any) -> list[torch.Tensor]:
    """The torch tensors autograd accumulates ``x``'s gradient into."""
    if not isinstance(x, Tensor):
        return [x]
    return list(x.held.buffers())


def _gradient(x: Any, got: Sequence[torch.Tensor | None]) -> Any:
    """``x``'s gradient from the gradients of its :func:`_leaves` (None if all None)."""
    if not isinstance(x, Tensor):
        return got[0]
    if all(g is None for g in got):
        return None
    return x.grads_of(got)


@register(torch.autograd.grad)
def grad(outputs: Any, inputs: Any, grad_outputs: Any = None,
         retain_graph: bool | None = None, create_graph: bool = False,
         only_inputs: bool = True, allow_unused: bool | None = None,
         is_grads_batched: bool = False, materialize_grads: bool = False
         ) -> tuple[Any, ...]:
    """``torch.autograd.grad`` with shardwise outputs, inputs or grad_outputs: each
    gradient in its input's layout (module doc).

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True,
    ...                      sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> (g,) = torch.autograd.grad((x * x).sum(), [x])
    >>> g.to_torch().tolist(), g.dist_layout == x.dist_layout
    ([2.0, 4.0, 6.0, 8.0], True)
    """
    if is_grads_batched:
        raise ShardingError(
            "torch.autograd.grad(..., is_grads_batched=True) has no shardwise form (it "
            "vmaps torch's engine over the seeds, and vmap cannot see into a shardwise "
            "Tensor). Call torch.autograd.grad once per seed, with retain_graph=True.")
    allow = bool(allow_unused) or materialize_grads
    outputs = _as_tuple(outputs)
    inputs = _as_tuple(inputs)
    outs, seeds = _roots(outputs, _as_tuple(grad_outputs, len(outputs)))
    leaves = [_leaves(x) for x in inputs]
    flat = [leaf for group in leaves for leaf in group]
    for x in inputs:
        if isinstance(x, torch.Tensor) and not x.requires_grad:
            raise RuntimeError(f"One of the differentiated Tensors does not require grad "
                               f"({x!r:.120}).")
    got = torch.autograd.grad(outs, flat, seeds, retain_graph=retain_graph,
                              create_graph=create_graph, allow_unused=True)
    result: list[Any] = []
    at = 0
    for x, group in zip(inputs, leaves):
        g = _gradient(x, got[at:at + len(group)])
        at += len(group)
        if g is None:
            if not allow:
                raise RuntimeError(_UNUSED.format(what=f"{x!r:.120}"))
            if materialize_grads:
                g = torch.zeros_like(x)
                if create_graph:
                    g.requires_grad_(True)
        result.append(g)
    return tuple(result)


@register(torch.autograd.backward)
def backward(tensors: Any, grad_tensors: Any = None, retain_graph: bool | None = None,
             create_graph: bool = False, grad_variables: Any = None,
             inputs: Any = None) -> None:
    """``torch.autograd.backward`` with shardwise tensors, seeds or inputs: accumulates
    into ``.grad`` of the leaves (of ``inputs`` only, when given), each shown in its
    tensor's layout.

    >>> mesh = DeviceMesh.cpu(2, "x")
    >>> x = shardwise.tensor([1.0, 2.0], requires_grad=True,
    ...                      sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> torch.autograd.backward([x * 3], [torch.ones(2)])
    >>> x.grad.to_torch().tolist()
    [3.0, 3.0]
    """
    tensors = _as_tuple(tensors)
    if grad_tensors is None:
        grad_tensors = grad_variables
    outs, seeds = _roots(tensors, _as_tuple(grad_tensors, len(tensors)))
    leaves = None if inputs is None else [
        leaf for x in _as_tuple(inputs) for leaf in _leaves(x)]
    torch.autograd.backward(outs, seeds, retain_graph=retain_graph,
                            create_graph=create_graph, inputs=leaves)
