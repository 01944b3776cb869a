"""kv_buffers.BufferPool: which free buffer a take gets, and what a give keeps."""

from adpfleet.runtime.executor.kv_buffers import ALIGN, BufferPool


def test_take_reuses_the_smallest_free_buffer_that_fits_among_buffers_of_different_sizes():
    pool = BufferPool()
    small, large, medium = pool.take(1), pool.take(3 * ALIGN), pool.take(2 * ALIGN)
    for b in (large, small, medium):
        pool.give(b)
    assert pool.take(ALIGN + 1) is medium
    assert pool.take(10) is small
    assert pool.take(3 * ALIGN) is large
    assert pool.allocated == 3
    fresh = pool.take(ALIGN)  # nothing free: a new buffer, whole MiB
    assert pool.allocated == 4 and fresh.numel() == ALIGN


def test_give_past_the_limit_drops_the_largest_free_buffers_first():
    pool = BufferPool(max_free_bytes=3 * ALIGN)
    a, b, c = pool.take(ALIGN), pool.take(2 * ALIGN), pool.take(3 * ALIGN)
    for buffer in (a, b, c):
        pool.give(buffer)
    assert pool.take(1) is a and pool.take(1) is b  # c (3 MiB) went: 6 MiB free was over the limit
    assert pool.allocated == 3 and pool.take(3 * ALIGN) is not c
