"""Fresh host buffers: huge-page advice for large mapped blocks, values intact."""

from __future__ import annotations

import resource

import torch

from shardwise.runtime import buffers


def _faults_touching(t: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_empty_is_new_empty() -> None:
    like = torch.zeros(2, dtype=torch.float64)
    t = buffers.empty((3, 4), like)
    assert t.shape == (3, 4) and t.dtype == torch.float64 and t.device == like.device
    assert t.is_contiguous()
    assert t.untyped_storage().data_ptr() != like.untyped_storage().data_ptr()


def test_large_block_gets_huge_pages_when_the_kernel_allows() -> None:
    like = torch.empty(0)
    n = 40 * 2**20 // 4  # 40 MiB of float32: above glibc's mmap cap, so a fresh mapping
    was = buffers.huge_pages()
    try:
        buffers.set_huge_pages(False)
        plain = _faults_touching(buffers.empty((n,), like))
        assert buffers.set_huge_pages(True) == was
        t = buffers.empty((n,), like)
        advised = _faults_touching(t)
        assert bool(t.eq(1.0).all())
    finally:
        buffers.set_huge_pages(was)
    if was:  # Linux, THP mode "madvise": 2 MiB pages, so at least 4x fewer faults
        assert advised * 4 < plain, (advised, plain)
    else:
        assert advised > 0 and plain > 0


def test_set_huge_pages_off_reports_off() -> None:
    was = buffers.huge_pages()
    try:
        assert buffers.set_huge_pages(False) is False
        assert buffers.huge_pages() is False
    finally:
        buffers.set_huge_pages(was)
