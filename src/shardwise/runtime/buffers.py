"""Fresh host buffers without the page-fault bill.

glibc maps every block above its mmap threshold (at most 32 MiB) fresh and
unmaps it on free, so each new 64 MiB result faults in 16384 4-KiB pages, which
costs more than copying its bytes (far more on a VM whose host backs guest pages
lazily). Large results of shardwise ops come from
:func:`empty`, which avoids that:

- **The pool** (on by default, :func:`set_pool_limit`): a result above 4 MiB
  (glibc maps those fresh or not, depending on its history of frees) is written
  into an anonymous mapping lent from a pool; when the result's storage dies,
  the mapping returns to the pool with its pages still mapped, so the next
  result of that size faults nothing. At most 512 MiB stay idle.
- **Huge pages** (with the pool off, or for a new mapping): blocks are advised
  to use transparent huge pages (``madvise(MADV_HUGEPAGE)``, when the kernel's
  THP mode is ``madvise``): they fault in 2 MiB pages, 512 times fewer faults.
- :func:`set_buffer_reuse` (opt-in, process-wide, glibc ``mallopt``): glibc
  serves every block from its heap and keeps freed memory; :func:`empty` then
  leaves allocation to it.
- :func:`by_address` says when a tensor's host memory is its values in order, so
  its bytes may be copied by address (``ctypes.memmove``) instead of by torch calls.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import platform
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardwise.runtime.blocks import recording

__all__ = ["MAPPED", "SMALL_BYTES", "buffer_reuse", "by_address", "empty", "huge_pages",
           "out_buffer", "pool_limit", "set_buffer_reuse", "set_huge_pages", "set_pool_limit"]

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters (malloc.h)
_GLIBC_MMAP_MAX, _GLIBC_TRIM_THRESHOLD = 65536, 128 * 1024  # glibc's defaults
_enabled = False


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)  # this process's symbols: glibc's malloc is among them
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


def set_buffer_reuse(enabled: bool = True) -> bool:
    """Opt in (or out) of reusing freed host buffers for new results; returns
    whether the setting took effect (glibc on Linux only; elsewhere a no-op).

    Why: glibc serves blocks above its mmap threshold (at most 32 MiB) with fresh
    ``mmap`` pages and unmaps them on free, so every fresh 64 MiB result page-faults
    all its pages again, which costs more than copying the bytes.
    Enabled, glibc serves every block from its heap (``M_MMAP_MAX = 0``) and keeps
    freed memory (``M_TRIM_THRESHOLD`` = 2 GiB), so a new result reuses the pages of
    one that died. Safe by construction: malloc never hands out memory a live
    tensor holds. Costs: process-wide; the resident size stays at its high-water
    mark (freed memory is kept for reuse, not returned to the OS).

    Disabling restores glibc's defaults for both parameters and trims the heap;
    glibc's *dynamic* mmap threshold stays off for the rest of the process. (The
    ``MALLOC_MMAP_MAX_``/``MALLOC_TRIM_THRESHOLD_`` environment variables are not
    equivalent: set before start-up, they left 64 MiB results page-faulting here.)
    """
    global _enabled
    libc = _libc()
    if libc is None:
        return False
    if enabled:
        ok = libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    else:
        ok = (libc.mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX)
              and libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_TRIM_THRESHOLD))
        libc.malloc_trim(0)
    _enabled = bool(ok) and enabled
    return bool(ok)


def buffer_reuse() -> bool:
    """Whether :func:`set_buffer_reuse` is on."""
    return _enabled


# --- transparent huge pages for fresh mapped blocks ----------------------------------------
MAPPED = 32 * 2**20  # glibc maps blocks above this fresh in every mode (its threshold's cap)
#: results above this come from the pool: glibc maps blocks between its default mmap
#: threshold (128 KiB) and MAPPED fresh or not depending on its dynamic threshold (the
#: history of frees), so such a result's cost changed from one process to the next
POOLED = 4 * 2**20
SMALL_BYTES = 1 << 18
"""Tensors of at most this many bytes (per Partial group) take the few-calls path:
there a torch call costs more than copying the data."""

_HUGE = 2 * 2**20     # the huge page size on x86-64 and arm64 (4 KiB base pages)
_MADV_HUGEPAGE = 14   # asm-generic/mman-common.h


@functools.lru_cache(maxsize=1)
def _thp_madvise() -> bool:
    """True when the kernel gives huge pages to advised regions only (mode ``madvise``);
    in mode ``always`` they come anyway, in mode ``never`` not at all."""
    if _libc() is None or platform.machine() not in ("x86_64", "aarch64", "arm64"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[madvise]" in mode


_huge = True


def set_huge_pages(enabled: bool = True) -> bool:
    """Turn huge-page advice for fresh mapped blocks on (the default) or off; returns
    whether it is in effect (Linux with THP in ``madvise`` mode only).

    >>> from shardwise.runtime import buffers
    >>> buffers.set_huge_pages(False)
    False
    >>> buffers.set_huge_pages(True) == buffers.huge_pages()  # back on (where THP allows)
    True
    """
    global _huge
    _huge = enabled
    return huge_pages()


def huge_pages() -> bool:
    """Whether :func:`empty` advises fresh mapped blocks to use huge pages.

    >>> from shardwise.runtime import buffers
    >>> buffers.huge_pages() == buffers._thp_madvise()  # on by default, where THP allows
    True
    """
    return _huge and _thp_madvise()


def _advise_huge(address: int, nbytes: int) -> None:
    start = -(-address // _HUGE) * _HUGE
    end = (address + nbytes) // _HUGE * _HUGE
    if end > start and huge_pages():
        _libc().madvise(start, end - start, _MADV_HUGEPAGE)  # advice: failure is harmless


# --- the pool of large result buffers ------------------------------------------------------
class _Pool:
    """Idle anonymous mappings by size (rounded up to 2 MiB), at most ``limit`` bytes.
    A mapping is lent to one result; when that result's storage dies (the numpy
    array that owns it is collected), the mapping comes back here with its pages
    still mapped, so the next result of that size page-faults nothing."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.idle: dict[int, list[mmap.mmap]] = {}
        self.idle_bytes = 0
        # Reentrant: a garbage collection inside give() may run another finalizer,
        # which calls give() again on the same thread.
        self.lock = threading.RLock()

    def take(self, size: int) -> mmap.mmap:
        with self.lock:
            free = self.idle.get(size)
            if free:
                self.idle_bytes -= size
                return free.pop()
        mm = mmap.mmap(-1, size)
        address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        _advise_huge(address, size)  # (the ctypes export ends with this statement)
        return mm

    def give(self, mm: mmap.mmap) -> None:
        # Called while the dying array still holds its export of ``mm``: keep or drop
        # the reference, never close (the mapping goes when its last reference does).
        size = len(mm)
        with self.lock:
            if self.idle_bytes + size <= self.limit:
                self.idle.setdefault(size, []).append(mm)
                self.idle_bytes += size

    def clear(self) -> None:
        with self.lock:
            self.idle, self.idle_bytes = {}, 0


_pool = _Pool(512 * 2**20)


def set_pool_limit(nbytes: int) -> None:
    """Keep at most ``nbytes`` of idle large result buffers for reuse (default 512 MiB;
    0 turns the pool off and frees what it holds).

    >>> from shardwise.runtime import buffers
    >>> buffers.set_pool_limit(0)            # off: large results allocate fresh
    >>> buffers.set_pool_limit(256 * 2**20)  # on again, at most 256 MiB idle
    """
    if nbytes < 0:
        raise ValueError(f"set_pool_limit needs a byte count >= 0, got {nbytes}.")
    _pool.limit = nbytes
    if nbytes == 0:
        _pool.clear()


def pool_limit() -> int:
    """The idle-byte limit of the large-result pool (0: off).

    >>> from shardwise.runtime import buffers
    >>> buffers.pool_limit() // 2**20  # MiB, by default (set_pool_limit changes it)
    512
    """
    return _pool.limit


def _pooled(shape: Sequence[int], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    size = -(-nbytes // _HUGE) * _HUGE
    mm = _pool.take(size)
    owner = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
    done = weakref.finalize(owner, _pool.give, mm)  # runs when the last view of it dies
    done.atexit = False
    return torch.from_numpy(owner).view(dtype).view(tuple(shape))


def _modes_active() -> bool:
    """True under a torch dispatch mode (e.g. FakeTensorMode), where new tensors are
    not plain memory. Modes that only observe (``plain_memory = True``, e.g. the
    shard_map write guard) do not count."""
    # (torch._C._len_torch_dispatch_mode, used before, does not exist in torch 2.13: the
    # check was always False.)
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return not all(getattr(m, "plain_memory", False) for m in _get_current_dispatch_mode_stack())


def by_address(t: torch.Tensor) -> bool:
    """``t``'s values are its host memory, in order: a CPU, strided, contiguous tensor
    without a pending conjugate or negative bit. Its ``t.numel() * t.element_size()``
    bytes from ``t.data_ptr()`` may then be copied by address (what the process
    runtime's hot paths do, where each torch call is costly on a cold cache).

    >>> x = torch.arange(6.0).reshape(2, 3)
    >>> by_address(x), by_address(x.t()), by_address(torch.ones(2, dtype=torch.cfloat).conj())
    (True, False, False)
    """
    return (t.device.type == "cpu" and t.layout is torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg())


def empty(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """``like.new_empty(shape)``, for a result about to be written whole. A host block
    that glibc may map fresh (above 4 MiB, :data:`POOLED`; buffer reuse off) instead
    comes from the pool of large result buffers (pages already mapped: no page faults),
    or, with the pool off, one above 32 MiB is advised to use huge pages before its
    first touch. Why not advise
    every block: advising heap memory would split the heap's mapping for good.

    >>> from shardwise.runtime import buffers
    >>> out = buffers.empty((4096, 4096), torch.empty(0))  # 64 MiB: from the pool
    >>> out.shape, out.dtype
    (torch.Size([4096, 4096]), torch.float32)
    """
    nbytes = math.prod(shape) * like.element_size()
    if (nbytes <= POOLED or _enabled or like.device.type != "cpu"
            or type(like) is not torch.Tensor or _modes_active()):
        return like.new_empty(shape)  # (fake/meta tensors and dispatch modes: no memory)
    if _pool.limit > 0:
        return _pooled(shape, like.dtype, nbytes)
    t = like.new_empty(shape)
    if nbytes > MAPPED:  # surely a fresh mapping: never advise the heap's memory
        _advise_huge(t.data_ptr(), nbytes)
    return t


def out_buffer(shape: Sequence[int], like: torch.Tensor, inputs: Sequence[torch.Tensor]
               ) -> torch.Tensor | None:
    """The ``out=`` buffer of a result computed from ``inputs``: one from
    :func:`empty` (the pool) when glibc may map it fresh (above 4 MiB),
    else None (a plain allocation); always None while autograd records ``inputs``
    (``out=`` is not differentiable).

    >>> x = torch.ones(8)
    >>> out_buffer((8,), x, [x]) is None  # small: torch allocates as usual
    True
    """
    if math.prod(shape) * like.element_size() <= POOLED or recording(inputs):
        return None
    return empty(shape, like)
