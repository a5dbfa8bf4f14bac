"""``MemoryTracker``: the bytes of live blocks on each device during a step, measured.

Invariants:
- Measured, not predicted: every storage the block allocates is seen as it is made and
  as it dies (``debug/ledger.py``), and so are the values alive when the block starts;
  each is charged to the devices whose blocks it holds, so replicas sharing one buffer
  on the simulated mesh count once per device, as on one process per device.
- What the simulated runtime leaves out, a process per device holds: a layout change of
  a value held whole (metadata here) counts the moved blocks while the moved value
  lives, and ``fully_shard`` gathers count the gathered blocks from the gather until
  the unit's forward (or backward) ends, as they are freed on processes.
- Categories: ``params`` (``nn.Parameter`` values alive at the start), ``grads``
  (their gradients), ``optimizer`` (the state of every optimizer alive), ``activations``
  (everything else: saved activations, temporaries, inputs). A plain torch tensor of the
  first three counts whole on every device (as ``memory_per_device``); other plain
  tensors count where an op uses them on a mesh (replicated there), else not at all.
- ``import shardwise.debug`` stays torch-free: the ledger is imported on enter.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

__all__ = ["MemoryTracker"]


class MemoryTracker:
    """``with MemoryTracker() as mt:`` measures the bytes of live blocks per device
    during the block: ``mt.peak`` on the most loaded device (``mt.device``),
    ``mt.per_device`` for each, ``mt.at_peak`` what it held then, by category.

    >>> import torch.nn as nn
    >>> from shardwise.parallel import fully_shard
    >>> mesh = DeviceMesh.cpu(4, "dp")
    >>> model = fully_shard(nn.Linear(64, 64, bias=False), mesh)   # 16 KiB of weight
    >>> x = shardwise.tensor(torch.ones(8, 64), sharding=PlacementMapping(mesh, [Sharded(0)]))
    >>> with MemoryTracker() as mt:
    ...     model(x).sum().backward()
    >>> mt.at_peak["params"], mt.final["grads"]      # a quarter of the weight each
    (4096, 4096)
    >>> mt.peak >= 4096 + 16384                      # the gathered weight in forward
    True
    """

    def __init__(self, state: Any = None, *, ledger: Any = None) -> None:
        """``state``: the modules, optimizers and tensors whose values are held when the
        block starts (default: every one alive, found by the garbage collector);
        ``ledger``: the :class:`~shardwise.debug.ledger.Ledger` to record into (one that
        also records ops, as ``shardwise.estimate`` passes)."""
        self._state = state
        self._given = ledger
        self._ledger: Any = None
        self._params: list[Any] = []
        self._optimizers: list[Any] = []
        self._hooks: list[Any] = []
        self._result: Any = None

    def __enter__(self) -> MemoryTracker:
        import torch

        from shardwise.debug.ledger import Ledger

        ledger = self._ledger = self._given if self._given is not None else Ledger()
        values, optimizers = _held(self._state)
        self._optimizers = optimizers
        for v in values:
            if isinstance(v, torch.nn.Parameter):
                self._params.append(v)
                ledger.categorize(v, "params")
                if v.grad is not None:
                    ledger.categorize(v.grad, "grads")
        ledger.discover(values)
        self._optimizer_state()
        from shardwise.tensors.tensor import Tensor

        for p in self._params:
            for b in p.held.buffers() if isinstance(p, Tensor) else (p,):
                if b.requires_grad and b.grad_fn is None:
                    self._hooks.append(b.register_post_accumulate_grad_hook(self._grad))
        ledger.start()
        return self

    def _grad(self, leaf: Any) -> None:
        if leaf.grad is not None and self._ledger is not None:
            self._ledger.categorize(leaf.grad, "grads")

    def _optimizer_state(self) -> None:
        from shardwise.debug.ledger import iter_tensors

        for opt in self._optimizers:
            for t in iter_tensors(list(opt.state.values())):
                self._ledger.categorize(t, "optimizer")

    def __exit__(self, *exc: object) -> None:
        ledger = self._ledger
        ledger.stop()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for p in self._params:
            if p.grad is not None:
                ledger.categorize(p.grad, "grads")
        self._optimizer_state()
        self._result = ledger.replay()
        self._ledger = None
        self._params.clear()
        self._optimizers = []

    def _done(self) -> Any:
        if self._result is None:
            raise RuntimeError("MemoryTracker: read peak, per_device and at_peak after the "
                               "`with MemoryTracker() as mt:` block has ended.")
        return self._result

    @property
    def peak(self) -> int:
        """Peak bytes of live blocks on the most loaded device."""
        return int(self._done().peak)

    @property
    def device(self) -> Any:
        """The most loaded device (the one whose peak is :attr:`peak`)."""
        r = self._done()
        return r.devices[r.device] if r.devices else None

    @property
    def per_device(self) -> dict[Any, int]:
        """Each device's own peak bytes."""
        r = self._done()
        return dict(zip(r.devices, r.per_device))

    @property
    def at_peak(self) -> dict[str, int]:
        """Bytes per category on the most loaded device at its peak."""
        return dict(self._done().at_peak)

    @property
    def most(self) -> dict[str, int]:
        """Each category's largest holding on the most loaded device during the block."""
        return dict(self._done().most)

    @property
    def final(self) -> dict[str, int]:
        """Bytes per category on the most loaded device when the block ended."""
        return dict(self._done().final)

    def __repr__(self) -> str:
        if self._result is None:
            return "MemoryTracker(running)" if self._ledger is not None else "MemoryTracker()"
        parts = ", ".join(f"{k} {v}" for k, v in self.at_peak.items())
        return f"MemoryTracker(peak {self.peak} B on {self.device}: {parts})"


def _held(state: Any) -> tuple[list[Any], list[Any]]:
    """The tensors (shardwise Tensors and parameters) and optimizers of ``state`` (modules,
    optimizers, tensors, nested in lists, tuples and dicts), or every live one (None)."""
    import torch

    from shardwise.tensors.tensor import Tensor

    values: list[Any] = []
    optimizers: list[Any] = []
    if state is None:
        from torch._subclasses.fake_tensor import is_fake

        # values in cycles that died hold no memory; a cycle's finalizers can release
        # another cycle, which only the next pass frees
        for _ in range(4):
            if not gc.collect():
                break
        with warnings.catch_warnings():  # (isinstance on deprecated torch objects warns)
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if isinstance(obj, Tensor):
                    first = obj.held.first()
                    if first is not None and not is_fake(first):  # (fakes hold nothing)
                        values.append(obj)
                elif isinstance(obj, torch.nn.Parameter) and not is_fake(obj):
                    values.append(obj)
                elif isinstance(obj, torch.optim.Optimizer):
                    optimizers.append(obj)
        return values, optimizers
    todo = [state]
    while todo:
        x = todo.pop()
        if isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, torch.nn.Module):
            values.extend(x.parameters())
            values.extend(b for b in x.buffers() if isinstance(b, Tensor))
        elif isinstance(x, torch.optim.Optimizer):
            optimizers.append(x)
        elif isinstance(x, torch.Tensor):
            values.append(x)
    return values, optimizers
