"""Fresh host buffers: the pool of large results, huge-page advice, values intact."""

from __future__ import annotations

import gc
import resource
from collections.abc import Iterator

import pytest
import torch

from shardwise.runtime import buffers

BIG = 40 * 2**20 // 4  # 40 MiB of float32: above glibc's mmap cap (buffers.MAPPED)


def _faults_touching(t: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.fixture
def pool() -> Iterator[None]:
    was = buffers.pool_limit()
    buffers.set_pool_limit(0)  # start empty
    buffers.set_pool_limit(512 * 2**20)
    yield
    buffers.set_pool_limit(0)
    buffers.set_pool_limit(was)


def test_empty_is_new_empty() -> None:
    like = torch.zeros(2, dtype=torch.float64)
    t = buffers.empty((3, 4), like)
    assert t.shape == (3, 4) and t.dtype == torch.float64 and t.device == like.device
    assert t.is_contiguous()
    assert t.untyped_storage().data_ptr() != like.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex64])
def test_pooled_buffer_is_a_plain_tensor(pool: None, dtype: torch.dtype) -> None:
    like = torch.zeros(1, dtype=dtype)
    t = buffers.empty((BIG // 1024, 1024), like)
    assert t.shape == (BIG // 1024, 1024) and t.dtype == dtype and t.is_contiguous()
    assert not t.requires_grad
    t.fill_(3)
    assert bool(t.eq(3).all())
    assert torch.equal(t.clone(), t)


def test_pool_reuses_a_dead_result_without_page_faults(pool: None) -> None:
    like = torch.empty(0)
    first = buffers.empty((BIG,), like)
    ptr = first.data_ptr()
    _faults_touching(first)
    del first
    gc.collect()
    again = buffers.empty((BIG,), like)
    assert again.data_ptr() == ptr
    assert _faults_touching(again) < 64


def test_pool_never_lends_a_live_buffer_twice(pool: None) -> None:
    like = torch.empty(0)
    a = buffers.empty((BIG,), like)
    view = a[10:20]  # a view keeps the buffer lent
    a_ptr = a.data_ptr()
    del a
    gc.collect()
    b = buffers.empty((BIG,), like)
    assert b.data_ptr() != a_ptr
    view.fill_(7.0)
    b.fill_(0.0)
    assert bool(view.eq(7.0).all())


def test_pool_keeps_at_most_its_limit(pool: None) -> None:
    like = torch.empty(0)
    size = -(-BIG * 4 // (2 * 2**20)) * 2 * 2**20
    buffers.set_pool_limit(size)
    a, b = buffers.empty((BIG,), like), buffers.empty((BIG,), like)
    del a, b
    gc.collect()
    assert buffers._pool.idle_bytes == size
    with pytest.raises(ValueError, match=">= 0"):
        buffers.set_pool_limit(-1)


def test_pool_off_allocates_fresh(pool: None) -> None:
    buffers.set_pool_limit(0)
    like = torch.empty(0)
    a = buffers.empty((BIG,), like)
    assert buffers._pool.idle_bytes == 0
    del a
    gc.collect()
    assert buffers._pool.idle_bytes == 0


def test_large_block_gets_huge_pages_when_the_kernel_allows(pool: None) -> None:
    buffers.set_pool_limit(0)  # plain allocations: advice is all that differs
    like = torch.empty(0)
    was = buffers.huge_pages()
    try:
        buffers.set_huge_pages(False)
        plain = _faults_touching(buffers.empty((BIG,), like))
        assert buffers.set_huge_pages(True) == was
        t = buffers.empty((BIG,), like)
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


def test_pool_under_threads_never_shares_a_live_buffer(pool: None) -> None:
    import threading

    like = torch.empty(0)
    n = (buffers.MAPPED + 2**20) // 4
    errors: list[str] = []
    finished: list[float] = []

    def work(tag: float) -> None:
        # A thread that crashes or hangs must fail the test: record the crash, and
        # count the threads that got to the end.
        try:
            for _ in range(5):
                t = buffers.empty((n,), like)
                t.fill_(tag)
                if not bool(t.eq(tag).all()):
                    errors.append(f"buffer of {tag} overwritten")
                del t
                gc.collect()
            finished.append(tag)
        except BaseException as err:
            errors.append(f"thread {tag}: {err!r}")

    threads = [threading.Thread(target=work, args=(float(i),), daemon=True) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not [th for th in threads if th.is_alive()], "a thread hung"
    assert not errors
    assert sorted(finished) == [0.0, 1.0, 2.0, 3.0], finished
    assert buffers._pool.idle_bytes <= buffers.pool_limit()


def test_dispatch_modes_bypass_the_pool_unless_they_only_observe() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardwise.spmd.guard import _Guard

    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    assert not buffers._modes_active()
    with Other():
        assert buffers._modes_active()
    with _Guard({}):
        assert not buffers._modes_active()  # shard_map's write guard: plain memory
        with Other():
            assert buffers._modes_active()
