"""Opt-in reuse of freed host buffers for new results (glibc ``mallopt``)."""

from __future__ import annotations

import ctypes
import functools
import platform
from typing import Any

__all__ = ["buffer_reuse", "set_buffer_reuse"]

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
