"""Read-only shared mappings of a store's segment files (:class:`SegmentMaps`): the SSD tier
reads records by copying them out of the mapped files, not by a system call per record.

Measured on the 2-core benchmark machine (``docs/ssd-tier.md``), 148-byte records at random: with
the pages in the page cache and mapped, 13-23 million records a second against about a million
with one ``pread`` each; from the disk (page cache dropped, 16 threads), 57k a second against
35k. The mappings are ``MADV_RANDOM``: a fault reads its page, not the read-ahead window around it.

What that costs: a page a read touched stays mapped, so it counts in the process's resident set
(``VmRSS``, as ``RssFile``) for as long as it is in the page cache. It is page cache all the
same - clean or written back by the kernel, shared, dropped under memory pressure without swap,
and charged to the process's memory cgroup whichever way it was read; with ``pread`` it was there
too, uncounted. So that the resident set stays bounded all the same, segments are mapped only while
the mapped ones total at most ``budget`` bytes (``SsdConfig.mapped_bytes``); the others are read
with one ``pread`` a record. Letting mapped pages go once they pass a budget was tried first:
estimating what a read maps (a fault maps the cached pages of its fault-around window, or a whole
large folio) let 19.6 GB and then 8.1 GB be mapped under 1 GiB, and measuring it after each read
still let one step's reads map 3 GB more before the check.

A read error of the disk under a mapping is ``SIGBUS`` (the process stops, the last checkpoint
is intact), where ``pread`` would have raised ``EIO``.

Thread contract: :meth:`SegmentMaps.map` and :meth:`SegmentMaps.unmap` on the store's owner; a
reader on another thread (the prefetch worker's read-ahead) holds :attr:`SegmentMaps.lock` while
it copies, so no mapping it reads from goes away meanwhile.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_FAILED = ctypes.c_void_p(-1).value


class SegmentMaps:
    """One read-only ``MAP_SHARED`` mapping of ``length`` bytes per segment file.

    Attributes:
        bases: int64 address of each segment's mapping (0: none); a new array when it grows.
        lock: held while a mapping is made or let go, and by a reader on another thread.

    Raises:
        OSError: the system refused a mapping (its reason and the file).
    """

    def __init__(self, length: int, budget: int = 1 << 30) -> None:
        self.length, self.budget = length, budget
        self.bases = np.zeros(0, np.int64)
        self.lock = threading.Lock()
        self.mapped = 0  # bytes of the mappings made

    def grow(self) -> None:
        with self.lock:
            self.bases = np.append(self.bases, np.int64(0))

    def map(self, s: int, fd: int, name: object) -> None:
        """Map segment ``s`` from ``fd`` (its file, which may be shorter than ``length``: only the
        bytes written are read) where the budget has room, else leave it to be read with ``pread``;
        ``name``: the file, for an error."""
        if self.mapped + self.length > self.budget:
            return
        addr = _mmap(None, self.length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mapping {name} failed: {os.strerror(err)}")
        _madvise(addr, self.length, mmap.MADV_RANDOM)  # (a hint: its failure changes nothing)
        with self.lock:
            self.unmap_locked(s)
            self.bases[s] = addr
            self.mapped += self.length

    def slots(self, s: int, count: int, slot_bytes: int) -> np.ndarray | None:
        """The first ``count`` slots of segment ``s`` as a read-only ``(count, slot_bytes)`` uint8 view of
        its mapping (valid until it is let go), ``None`` where it is not mapped."""
        if not self.bases[s]:
            return None
        view = np.frombuffer((ctypes.c_uint8 * (count * slot_bytes)).from_address(int(self.bases[s])), np.uint8)
        view.flags.writeable = False  # (PROT_READ: a write would fault)
        return view.reshape(count, slot_bytes)

    def unmap(self, s: int) -> None:
        with self.lock:
            self.unmap_locked(s)

    def unmap_locked(self, s: int) -> None:
        if self.bases[s]:
            _munmap(int(self.bases[s]), self.length)
            self.bases[s] = 0
            self.mapped -= self.length

    def close(self) -> None:
        with self.lock:
            for s in range(self.bases.shape[0]):
                self.unmap_locked(s)

