"""Host memory: large tables 2 MiB-aligned and advised to use transparent huge pages; the C
allocator's freed memory kept between steps and handed back after one-off copies.

Embedding rows and their optimizer state are read in random order. Beyond the last-level cache
every such read is also a TLB miss with 4 KiB pages; with 2 MiB pages the page walk mostly
disappears. Linux backs an anonymous mapping with huge pages when asked through
``madvise(MADV_HUGEPAGE)`` (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise`` or
``always``). Measured on the 2-core benchmark machine: the LazyAdam update of 101k random rows of
a 26M x 16 table (5 GB with its state) took 4.8 ms instead of 6.6 ms.

Elsewhere (other OSes, no ``madvise``) this falls back to ``torch.empty``.

:func:`retain_freed_memory` keeps the C allocator from handing a training step's freed buffers
back to the kernel, which then faults them in again, page by page, at the next step;
:func:`returning_freed_memory` hands a checkpoint's copies back.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
from collections.abc import Iterator

import numpy as np
import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 4 * HUGE_PAGE  # smaller buffers gain nothing from huge pages

_NUMPY_DTYPE = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
                torch.int32: np.int32, torch.bfloat16: np.uint16}


def host_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor (``StorageTier.HOST_DRAM``), huge-page backed where supported.

    Anonymous mappings start zero-filled by the kernel, so the tensor's contents are zeros in
    practice; callers must not rely on that.
    """
    numel = int(np.prod(shape)) if shape else 1
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < MIN_BYTES or advise is None or dtype not in _NUMPY_DTYPE:
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(advise)
    except OSError:  # kernel without THP: plain pages are fine
        pass
    raw = np.frombuffer(buf, dtype=np.uint8)  # holds ``buf`` alive as long as any view exists
    start = (-raw.ctypes.data) % HUGE_PAGE
    arr = raw[start : start + nbytes].view(_NUMPY_DTYPE[dtype]).reshape(shape)
    t = torch.from_numpy(arr)  # shares memory; keeps ``arr`` (and so the mapping) alive
    return t.view(torch.bfloat16) if dtype is torch.bfloat16 else t


# glibc's mallopt(3) parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 64 << 20  # a block at least this large is its own mapping, unmapped when freed
TRIM_THRESHOLD = 256 << 20  # free memory at the top of the heap kept, up to this much
DEFAULT_THRESHOLD = 128 << 10  # glibc's initial value of both
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_kept: list[tuple[int, int]] = []  # the thresholds retain_freed_memory set in this process (mirrors malloc's own)


def retain_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Keep the C allocator (glibc's ``malloc``) from returning a step's freed buffers to the
    kernel: blocks under ``mmap_threshold`` bytes come from the heap, and free memory at the top
    of the heap is kept up to ``trim_threshold`` bytes (``mallopt(M_MMAP_THRESHOLD)``,
    ``mallopt(M_TRIM_THRESHOLD)``; the same as the environment variables ``MALLOC_MMAP_THRESHOLD_``
    and ``MALLOC_TRIM_THRESHOLD_``).

    Why: a training step allocates and frees tens of MB of temporaries (pooled outputs, their
    gradients, index arrays). By default glibc's thresholds adapt to the sizes freed so far and the
    heap is trimmed whenever its free top passes twice the adapted threshold, so from one process
    to the next (and within one) the same step either reuses its memory or unmaps it and takes a
    page fault for every 4 KiB page of it at the next step: measured on the 2-core benchmark
    machine, the in-memory embedding step of 26 x 200k x 32 rows (batches of 4,096) took 10.6 to
    21 ms over fresh processes with 0 to 6,624 minor page faults a step, and 10.2 to 11.3 ms with
    none in every process with these settings; the SSD tier's step 26-30 against 23 ms. Resident
    memory stays flat after warm-up (it keeps what the steps reuse, plus at most
    ``trim_threshold`` of free heap); larger blocks are still returned when freed.

    Process-global: the process's owner calls it (``hetero``'s command line does, first thing);
    a program embedding hetero may call it too. A checkpoint's one-off copies are returned as
    before (:func:`returning_freed_memory`). Nothing is changed where the environment already
    sets one of glibc's ``MALLOC_*`` thresholds (the user's choice) or where the C library has no
    ``mallopt`` (not glibc: another allocator, macOS). Returns whether the settings were applied.
    Thread contract: any thread; glibc serialises ``mallopt`` with allocations.
    """
    if any(k in os.environ for k in _ENV):
        return False
    done = _thresholds(mmap_threshold, trim_threshold)
    if done:
        _kept[:] = [(mmap_threshold, trim_threshold)]
    logging.getLogger("hetero").debug("hetero: malloc keeps freed memory (mmap threshold %d, trim threshold %d): %s",
                                      mmap_threshold, trim_threshold, done)
    return done


@contextlib.contextmanager
def returning_freed_memory() -> Iterator[None]:
    """A block of one-off allocations (a checkpoint's whole-table copies): the allocator's free
    memory is handed back to the system before it and after it (glibc's ``malloc_trim(0)``), and
    within it glibc's initial thresholds (128 KiB) rule where :func:`retain_freed_memory` set
    others, so the copies are mapped on their own and returned when freed; its settings again
    after. Without the trim after, the resident set stayed up by the last checkpoint's size (+250
    MiB a rank with row-sharded dynamic tables). Measured (``tests/test_memory_growth.py``, 2 ranks,
    row-sharded tables of 104 MiB with their state): a checkpoint's peak over the warm resident set
    was +732 and +836 MiB with the settings kept through it, +468 MiB with this block, +474 to +480
    MiB with glibc's default, adaptive thresholds. Nothing but the trims where the settings were
    not made; nothing at all where the C library is not glibc."""
    kept = list(_kept)
    _trim()  # (what the steps kept: the copies would come on top of it)
    if kept:
        _thresholds(DEFAULT_THRESHOLD, DEFAULT_THRESHOLD)
    try:
        yield
    finally:
        if kept:
            _thresholds(*kept[0])
        _trim()


@functools.cache  # (opened once: a checkpoint calls it twice)
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # (not glibc)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))


def _trim() -> None:
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:  # (not glibc: musl, macOS)
        trim(0)
