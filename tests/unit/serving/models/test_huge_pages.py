"""Huge-page buffers: aligned, disjoint, the right shapes, and on 2 MiB pages where the kernel lends them."""

from __future__ import annotations

from pathlib import Path

import torch

from serving.models.layers import huge_pages


def _thp_on_request() -> bool:
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return p.exists() and ("[madvise]" in p.read_text() or "[always]" in p.read_text())


def test_an_arena_hands_out_aligned_disjoint_buffers_in_order():
    arena = huge_pages.Arena(slab_bytes=1 << 20)
    bufs = [arena.bytes(n) for n in (100, 4096, 7, 300_000, 600_000)]  # the last: half a slab or more
    for b, n in zip(bufs, (100, 4096, 7, 300_000, 600_000)):
        assert b.numel() == n and b.data_ptr() % huge_pages.ALIGN == 0
        b.fill_(len(str(n)))
    for b, n in zip(bufs, (100, 4096, 7, 300_000, 600_000)):  # no buffer overlapped another
        assert bool((b == len(str(n))).all())
    assert bufs[0].data_ptr() < bufs[1].data_ptr() < bufs[2].data_ptr()  # carved in load order
    assert bufs[4].data_ptr() % huge_pages.HUGE_PAGE == 0  # a large one on its own
    t = arena.tensor((3, 5, 7), torch.float32)
    assert t.shape == (3, 5, 7) and t.dtype == torch.float32 and t.is_contiguous()


def test_empty_is_2_mib_aligned_and_asks_for_huge_pages():
    t = huge_pages.empty((4 << 20,), torch.float32)  # 16 MiB
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0 and t.numel() == 4 << 20
    if _thp_on_request():
        assert huge_pages.advise(t)
    t.zero_()
    assert float(t.sum()) == 0.0
