"""Weights and KV pools on 2 MiB pages, where the kernel lends transparent huge pages.

A decode step streams every weight once (~100 MB on SmolLM2 in Q4_1): on 4 KiB pages that is
~24 000 TLB misses a step, each a page walk on the load's critical path.  Debian's kernels lend
huge pages only to memory asked for with madvise(MADV_HUGEPAGE) (THP "madvise" mode), so the
buffers the kernels stream are asked for here before anything touches them.  Small weights
(a layer's projections are 0.2-1 MB) share 32 MiB slabs, so rounding to 2 MiB costs at most one
partly used page per slab, and each layer's weights lie in the order a step reads them.  Where
madvise is refused (no THP, another OS) the buffers are ordinary memory.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
SLAB_BYTES = 32 << 20
ALIGN = 64  # the kernels' loads: a cache line
_MADV_HUGEPAGE = 14


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MiB pages inside `t`; True when the kernel took it.
    Only memory not yet touched gets them at once (the first touch faults a huge page in)."""
    if _LIBC is None:
        return False
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    return _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0


def _typed(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The first numel(shape) elements of uint8 `buf` as a `dtype` tensor of `shape`."""
    return buf.view(dtype)[: torch.Size(shape).numel()].view(shape)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def empty(shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on huge pages: a tensor of its own, 2 MiB-aligned (the KV pool, a large weight)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = _nbytes(shape, dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    off = -raw.data_ptr() % HUGE_PAGE
    out = raw[off : off + nbytes]
    advise(out)
    return _typed(out, shape, dtype)


class Arena:
    """Byte buffers carved in order out of huge-page slabs; a buffer of half a slab or more gets
    its own.  A buffer keeps its slab alive; the arena holds only the slab it is filling."""

    def __init__(self, slab_bytes: int = SLAB_BYTES) -> None:
        self._slab_bytes = slab_bytes
        self._slab: torch.Tensor | None = None
        self._used = 0

    def bytes(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 tensor of `nbytes`, 64-byte aligned."""
        if nbytes >= self._slab_bytes // 2:
            return empty(nbytes, torch.uint8)
        if self._slab is None or self._used + nbytes > self._slab.numel():
            self._slab, self._used = empty(self._slab_bytes, torch.uint8), 0
        out = self._slab[self._used : self._used + nbytes]
        self._used = -(-(self._used + nbytes) // ALIGN) * ALIGN
        return out

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape` carved from the arena."""
        return _typed(self.bytes(_nbytes(shape, dtype)), shape, dtype)


WEIGHTS = Arena()  # the kernels' repacked weights, for every model this process loads
