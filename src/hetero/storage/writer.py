"""A store's appends on a thread of their own (:class:`SegmentWriter`): the training thread decides
where each record goes and goes on; the writer thread ``pwrite``s the slots and keeps each
segment's CRC-32, in the order they were handed over (both release the GIL). The CRC-32 is zlib's, computed by
zlib-ng (13 GB/s on the 2-core benchmark machine against zlib's 3.2: at 16 MB of appends a step, 1.2 ms of
a core against 5).

What the owner (the store's thread) may rely on: :attr:`SegmentWriter.written` says how many bytes
of each segment's file are written - a read checks it and, where its slot is not written yet,
waits (:meth:`SegmentWriter.drain`); :meth:`SegmentWriter.drain` returns once everything handed over
is written. Staging buffers come from a pool of ``pieces`` (:meth:`SegmentWriter.buffer`): the
memory in flight is bounded, and the owner waits when the writer is that far behind.

A failed write (``ENOSPC``, ``EFBIG``, ``EIO``) stops the writer: what was handed over after it is
not written, and every later hand-over or drain raises it (one line naming the file, as the
store words it).

Thread contract: every method on the owner's thread; the writer thread only writes
:attr:`written` and :attr:`crcs` at indices the owner handed it, after the owner set them.
"""

from __future__ import annotations

import collections
import errno
import os
import threading
import weakref
from collections.abc import Callable

import numpy as np
from zlib_ng import zlib_ng

def io_error(e: OSError, what: str, path: object, row: int = -1) -> OSError:
    """The one line of a failed ``what`` ("reading", "writing") of ``path`` (record ``row``; -1: none)."""
    full = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    fix = "free space there, or give another directory (tables.ssd_path)" if what == "writing" and full else \
        "check the disk (the system's log says more), or give another directory (tables.ssd_path)" \
        if what == "writing" else "check the disk (the file may be damaged)"
    record = f"record {row} in " if row >= 0 else ""
    return OSError(e.errno, f"{what} {record}{path} failed: {e.strerror}; {fix}")


ErrorOf = Callable[[OSError, int, int], OSError]  # (the system's error, the record's row, the segment) -> the one line


class _Shared:
    """What the owner and the writer thread share (the thread holds this, never the writer: a
    store let go without :meth:`SegmentWriter.close` ends its thread, :func:`weakref.finalize`)."""

    def __init__(self, slot_bytes: int, error: ErrorOf, pieces: int) -> None:
        self.slot_bytes, self.error = slot_bytes, error
        self.written: list[int] = []  # bytes of each segment's file written
        self.crcs: list[int] = []  # CRC-32 of each segment's bytes written
        self.jobs: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.pending = 0
        self.failed: BaseException | None = None
        self.pool = [np.empty((0, slot_bytes), np.uint8) for _ in range(pieces)]  # free staging buffers
        self.closed = False

    def stop(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class SegmentWriter:
    """The appends of one store (see the module docstring); ``error`` words a failed write."""

    def __init__(self, slot_bytes: int, error: ErrorOf, pieces: int = 3) -> None:
        self._s = _Shared(slot_bytes, error, pieces)
        self._thread = threading.Thread(target=_run, args=(self._s,), name="hetero-ssd-writer", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._s.stop)

    @property
    def written(self) -> list[int]:
        """Bytes of each segment's file written (the writer thread moves them on)."""
        return self._s.written

    @property
    def crcs(self) -> list[int]:
        """CRC-32 of each segment's bytes written."""
        return self._s.crcs

    def grow(self) -> None:
        """One more segment (nothing written)."""
        self._s.written.append(0)
        self._s.crcs.append(0)

    def reset(self, s: int, written: int = 0, crc: int = 0) -> None:
        """Segment ``s`` holds ``written`` bytes with CRC-32 ``crc`` (a new or reused file: 0; a
        linked one: its own). Only for a segment with nothing in flight."""
        self._s.written[s], self._s.crcs[s] = written, crc

    def buffer(self, rows: int) -> np.ndarray:
        """A staging buffer of at least ``rows`` slots (``(n, slot_bytes)`` uint8), from the pool:
        waits while every buffer is in flight."""
        sh = self._s
        with sh.cond:
            while not sh.pool:
                sh.cond.wait()
            buf = sh.pool.pop()
        if buf.shape[0] < rows:
            buf = np.empty((max(rows, 2 * buf.shape[0]), sh.slot_bytes), np.uint8)
        return buf

    def give_back(self, buf: np.ndarray) -> None:
        """A buffer from :meth:`buffer` that was not handed over."""
        with self._s.cond:
            self._s.pool.append(buf)
            self._s.cond.notify_all()

    def submit(self, s: int, fd: int, offset: int, slots: np.ndarray, rows: np.ndarray,
               buffer: np.ndarray | None = None) -> None:
        """Write ``slots`` (a view, left untouched until written) at byte ``offset`` of segment
        ``s``'s file ``fd``; ``rows``: their rows (for an error); ``buffer``: the pool's buffer
        they are in, back to the pool once written (the last hand-over from it names it).

        Raises:
            OSError: an earlier write failed.
        """
        self.check()
        with self._s.cond:
            self._s.jobs.append((s, fd, offset, slots, rows, buffer))
            self._s.pending += 1
            self._s.cond.notify_all()

    def check(self) -> None:
        if self._s.failed is not None:
            raise self._s.failed

    def drain(self) -> None:
        """Wait until everything handed over is written.

        Raises:
            OSError: a write failed.
        """
        with self._s.cond:
            while self._s.pending:
                self._s.cond.wait()
        self.check()

    def close(self) -> None:
        """Wait for the writes in flight (their failure is not raised here), and end the thread."""
        with self._s.cond:
            while self._s.pending:
                self._s.cond.wait()
        self._s.stop()
        self._thread.join()


def _run(sh: _Shared) -> None:
    while True:
        with sh.cond:
            while not sh.jobs and not sh.closed:
                sh.cond.wait()
            if not sh.jobs:
                return
            s, fd, offset, slots, rows, buffer = sh.jobs.popleft()
        try:
            if sh.failed is None:
                _write(sh, s, fd, offset, slots, rows)
        except BaseException as e:  # (unexpected: kept, traceback and all, for the owner to raise)
            sh.failed = e
        finally:
            with sh.cond:
                if buffer is not None:
                    sh.pool.append(buffer)
                sh.pending -= 1
                sh.cond.notify_all()


def _write(sh: _Shared, s: int, fd: int, offset: int, slots: np.ndarray, rows: np.ndarray) -> None:
    data = memoryview(slots).cast("B")
    done = 0
    try:
        while done < len(data):  # a short write (a limit reached) is followed by the one that says why
            done += os.pwrite(fd, data[done:], offset + done)
    except OSError as e:
        sh.failed = sh.error(e, int(rows[min(done // sh.slot_bytes, len(rows) - 1)]), s)
        return
    sh.crcs[s] = zlib_ng.crc32(data, sh.crcs[s])
    sh.written[s] = offset + done  # (last: a reader that sees it finds the bytes there)
