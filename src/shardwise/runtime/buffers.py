"""Fresh host buffers without the page-fault bill.

glibc maps every block above its mmap threshold (at most 32 MiB) fresh and
unmaps it on free, so each new 64 MiB result faults in 16384 4-KiB pages: on a
2-core host that costs ~3 copies of its bytes. Two remedies:

- :func:`empty` (on by default, per buffer): such blocks are advised to use
  transparent huge pages (``madvise(MADV_HUGEPAGE)``, when the kernel's THP
  mode is ``madvise``), so they fault in 2 MiB pages: 64 MiB costs ~1.5 copies
  instead of ~3.5. Nothing outside the buffer changes.
- :func:`set_buffer_reuse` (opt-in, process-wide): glibc serves every block
  from its heap and keeps freed memory, so new results reuse dead ones' pages.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["MAPPED", "buffer_reuse", "empty", "huge_pages", "set_buffer_reuse", "set_huge_pages"]

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
    all its pages again: on a 2-core host that costs ~3 copies of the bytes.
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
    whether it is in effect (Linux with THP in ``madvise`` mode only)."""
    global _huge
    _huge = enabled
    return huge_pages()


def huge_pages() -> bool:
    """Whether :func:`empty` advises fresh mapped blocks to use huge pages."""
    return _huge and _thp_madvise()


def empty(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """``like.new_empty(shape)``, for a result about to be written whole. A host block
    that glibc maps fresh (above 32 MiB, buffer reuse off) is advised to use huge
    pages before its first touch. Why only those: a fresh mapping is the buffer's
    own, so the advice dies with it; advising heap memory would split the heap's
    mapping for good."""
    t = like.new_empty(shape)
    nbytes = t.numel() * t.element_size()
    if nbytes > MAPPED and not _enabled and t.device.type == "cpu" and huge_pages():
        start = -(-t.data_ptr() // _HUGE) * _HUGE
        end = (t.data_ptr() + nbytes) // _HUGE * _HUGE
        if end > start:
            _libc().madvise(start, end - start, _MADV_HUGEPAGE)  # advice: failure is harmless
    return t
