"""shard_map's write guard: fn is stopped *before* it writes to an input block.

Input blocks share memory with the caller's values (a torch tensor passed to
shard_map, a shardwise Tensor's shards) and, on the simulated runtime, with the
other devices' blocks. A write would change the caller's data, so it must fail
before anything is written, not after.

Invariants:
- While fn runs (on each device's thread, or in each process), a
  ``TorchDispatchMode`` sees every aten op before it executes. An op whose schema
  marks an argument as written (in-place ops, ``out=``, ``copy_``, ``x[i] = v``,
  ``resize_`` ...) raises :class:`ShardingError` when that argument shares storage
  with an input block: the caller's data is untouched.
- Storages are compared by data pointer; zero-byte storages are ignored (a write
  to them changes nothing, and their pointers need not be unique).
- Writes that bypass torch's dispatcher (through ``.numpy()`` or a raw pointer)
  are not seen; shard_map's version-counter check after fn still reports the
  ordinary ones (``.data`` writes).
- Cost: one Python call per torch op inside fn, the price of never
  corrupting the caller's values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.sharding.errors import ShardingError

__all__ = ["guarded", "storages"]

_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written_args(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func``'s schema says it writes."""
    found = _WRITTEN.get(func)
    if found is None:
        found = _WRITTEN[func] = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write)
    return found


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        storage = t.untyped_storage()
        return storage.data_ptr() if storage.nbytes() else None
    except (RuntimeError, NotImplementedError):  # tensors without real storage
        return None


def storages(args: Iterable[tuple[int, torch.Tensor | None]]) -> dict[int, int]:
    """Storage key -> argument index, for the blocks ``(argument index, block)``.

    >>> storages([(0, torch.ones(2)), (1, None)]).values()
    dict_values([0])
    """
    out: dict[int, int] = {}
    for i, t in args:
        key = None if t is None else _storage_key(t)
        if key is not None:
            out.setdefault(key, i)
    return out


class _Guard(TorchDispatchMode):
    """Raises before an op writes to one of the protected storages."""

    plain_memory = True  # observes only: tensors made under it are ordinary memory

    def __init__(self, protected: dict[int, int]) -> None:
        super().__init__()
        self.protected = protected

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for pos, name in _written_args(func):
            target = args[pos] if pos < len(args) else kwargs.get(name)
            for t in target if isinstance(target, (list, tuple)) else (target,):
                if isinstance(t, torch.Tensor):
                    i = self.protected.get(_storage_key(t))  # type: ignore[arg-type]
                    if i is not None:
                        _refuse(func, i)
        return func(*args, **kwargs)


def _refuse(func: Any, i: int) -> None:
    raise ShardingError(
        f"shard_map: fn was about to write to argument {i}'s local block in place "
        f"({func}); stopped before the write. Blocks share memory with the caller's "
        "values (and, on the simulated runtime, with other devices' blocks), so fn must "
        "not write to them: use out-of-place ops (x = x + 1, not x += 1) or clone first."
    )


def guarded(fn: Callable[..., Any], protected: dict[int, int]) -> Callable[..., Any]:
    """``fn`` run under the write guard for the ``protected`` storages.

    >>> x = torch.ones(2)
    >>> guarded(lambda a: a.add_(1), storages([(0, x)]))(x)
    Traceback (most recent call last):
    ...
    shardwise.sharding.errors.ShardingError: shard_map: fn was about to write ...
    >>> x.tolist()
    [1.0, 1.0]
    """
    if not protected:
        return fn

    def run(*args: Any) -> Any:
        with _Guard(protected):
            return fn(*args)

    return run
