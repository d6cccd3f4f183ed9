"""Row records on a local disk: a table's rows with their sparse-optimizer state, one fixed-size
record per row, so that one read brings a row together with its state (the layout of FBGEMM's SSD
tables and OneFlow's OneEmbedding: ``[weight | state...]`` per row).

A :class:`RowFile` is a log-structured store of those records in segment files (see its
docstring). Reads copy records out of the mapped segments (:mod:`hetero.storage.mapping`) on numba's
pool, or read them on I/O threads, in compiled loops (:mod:`hetero.storage._kernels`); appends go to a
writer thread (:mod:`hetero.storage.writer`).
"""

from __future__ import annotations

import os
import shutil
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hetero._numba import num_threads
from hetero.checkpoint.io import fsync_path
from hetero.storage.layout import RecordLayout, StagedRecords, io_kernels
from hetero.storage.mapping import SegmentMaps
from hetero.storage.writer import SegmentWriter, io_error

MIN_CHUNK = 64  # the fewest records per task handed to an I/O thread (a batch is spread over all of them)
CHUNKS_PER_CORE = 4  # a mapped gather's chunks per core of numba's pool (a core another thread slows is not waited on)
APPEND_CHUNK = 1 << 16  # records appended per piece (bounds the staging buffer a store keeps)


class RowFile:
    """``rows`` records of ``layout`` in a log-structured store: the directory ``path`` (created; a directory there is
    replaced: it is scratch space of one run) of segment files; the initial records ``init(lo, hi)`` (``(hi - lo,
    record_bytes)`` uint8; default zeros), or none (``empty``: :func:`hetero.storage.snapshot.restore` fills the
    store); ``segment``: slots per segment (default: from ``rows``).

    The store is a sequence of segments of ``segment`` slots, each segment a file of its own; a slot holds a record
    and, before it, its row (int64). ``positions[r]`` is the slot (segment * ``segment`` + index) of row ``r``'s
    current record. Writes append (:meth:`write`, :meth:`store`): sequential writes into the current segment,
    whatever rows they hold; the record a row had before becomes garbage. When a new segment is needed and the store
    already holds ``GC_RATIO`` times as many slots as rows, the segment with the fewest live records is cleaned
    first - its live slots (a bit a slot tells them) read from its mapping, else from its file read whole, and
    appended, its file deleted and the segment number reused by a new file (greedy cleaning of a log-structured
    file system, Rosenblum & Ousterhout 1992). The store stays under ``GC_RATIO`` times its live slots (plus one
    segment), and the cleaner copies few records: a segment of cold rows never written back stays full and is never
    cleaned. (Writing records in place was measured first: 7k samples/s, ``docs/ssd-tier.md``.)

    A segment file is only ever appended to, and only while it is the current segment; after :meth:`seal` no file of
    the store changes again (the cleaner deletes and creates files, it never rewrites one): a checkpoint hard-links
    them (:mod:`hetero.storage.snapshot`). Each segment's CRC-32 is kept as it is written.

    Thread contract: one thread at a time (the cache's owner), except :meth:`stage`, which a prefetch worker may
    call meanwhile (it reads only; its records are checked when used); calls wait for their I/O threads.

    Raises:
        OSError: a failed read or write, naming the file, the record, the system's reason (``ENOSPC``, ``EIO``,
            ``EFBIG``) and the fix.
    """

    HEADER = 8  # the row of a slot, int64
    GC_RATIO = 1.4

    def __init__(self, path: str | os.PathLike, layout: RecordLayout, rows: int, threads: int = 8,
                 init: Callable[[int, int], np.ndarray] | None = None, segment: int | None = None,
                 empty: bool = False, mapped_bytes: int = 1 << 30) -> None:
        self.path, self.layout, self.rows, self.slot_bytes = Path(path), layout, rows, self.HEADER + layout.nbytes
        self.segment = segment or max(64, min(1 << 16, rows // 32))  # slots per segment
        self.shift = self.segment.bit_length() - 1 if self.segment & (self.segment - 1) == 0 else -1  # (kernels)
        shutil.rmtree(self.path, ignore_errors=True)  # (a previous run's scratch: this run starts from its own rows)
        self.path.mkdir(parents=True)
        self._pool, self.threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hetero-ssd-io"), threads
        self.positions = np.full(rows, -1, np.int64)  # row -> its slot (8 bytes a row of host memory)
        self.live = np.zeros(0, np.int64)  # live slots per segment
        self.live_bits = np.zeros(0, np.uint8)  # a bit a slot: set where a row's position points at it
        self.generation = np.zeros(0, np.int64)  # times each segment was freed (staged records check it)
        self.fds = np.zeros(0, np.int32)  # each segment's open file (-1: none)
        self.sizes = np.zeros(0, np.int64)  # bytes appended to each segment's file (handed to the writer)
        me = weakref.ref(self)  # (the writer's thread must not keep the store alive)
        self.writer = SegmentWriter(self.slot_bytes, lambda e, row, s: me()._error(e, "writing", row, s))
        self.maps = SegmentMaps(self.segment * self.slot_bytes, mapped_bytes)  # segment files mapped to be read
        self._owned = np.zeros(0, np.bool_)  # files this store made (and may write again when no snapshot links them)
        self._reused: set[int] = set()  # segments whose file is written again from its start (longer until sealed)
        self._unsynced: set[int] = set()  # segments written since the last seal
        self._free: list[int] = []
        # two streams of appends, each into its own current segment: write-backs (0) and the cleaner's moves (1), colder
        # (not written since appended): their segments stay full, the write-backs' are cleaned (hot/cold separation)
        self._tail, self._cleaning = [-1, -1], False
        self._tail_used, self.cleaned = [self.segment, self.segment], 0  # (no segment yet: the first append opens one)
        # the initial records (empty: a restore's) a segment a write: 2 MiB folios, fewer TLB misses (docs/ssd-tier.md)
        for lo in range(0, 0 if empty else rows, self.segment):
            hi = min(lo + self.segment, rows)
            data = init(lo, hi) if init is not None else np.zeros((hi - lo, layout.nbytes), np.uint8)
            self._append(np.arange(lo, hi, dtype=np.int64), np.ascontiguousarray(data))
        self.writer.drain()  # (laid out before it is used: a write the disk refuses is raised here)

    @property
    def crcs(self) -> list[int]:
        """CRC-32 of each segment's bytes written (complete after :meth:`seal`)."""
        return self.writer.crcs

    @property
    def nbytes(self) -> int:
        """Bytes the store's segments hold (live records, their rows, garbage and free segments)."""
        return self.live.shape[0] * self.segment * self.slot_bytes

    def segment_path(self, s: int) -> Path:
        return self.path / f"{s:06d}.seg"

    def _grow(self) -> int:
        """A new segment number at the end (no file yet)."""
        # (generation first: a stager reads positions, then generations)
        self.generation, self.fds = np.append(self.generation, 0), np.append(self.fds, np.int32(-1))
        self.sizes = np.append(self.sizes, 0)
        self._owned = np.append(self._owned, False)
        self.maps.grow()
        self.writer.grow()
        self.live = np.append(self.live, 0)
        self.live_bits = np.append(self.live_bits, np.zeros(self.segment // 8 + 1, np.uint8))  # (>= a bit a slot)
        return self.live.shape[0] - 1

    def _open(self, s: int) -> None:
        """An empty file for segment ``s``: its own file again where :meth:`_drop` kept it (written
        over from its start: its pages are in the page cache, where a new file's must be allocated
        - 10x the write rate measured), else a new one."""
        if self.fds[s] >= 0:
            self._reused.add(s)
        else:
            try:
                self.fds[s] = os.open(self.segment_path(s), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                self.maps.map(s, int(self.fds[s]), self.segment_path(s))
            except OSError as e:
                raise self._error(e, "writing", -1, s) from None
            self._owned[s] = True
        self.sizes[s] = 0
        self.writer.reset(s)  # (nothing of it is in flight: a freed segment's writes ended before it was read)

    def attach(self, s: int, size: int, crc: int) -> None:
        """Segment ``s`` is the file at :meth:`segment_path` (a snapshot's, linked in), ``size``
        bytes with CRC-32 ``crc``: opened to be read (never written: it is not this store's)."""
        while self.live.shape[0] <= s:
            self._grow()
        self.fds[s] = os.open(self.segment_path(s), os.O_RDONLY)
        self.maps.map(s, int(self.fds[s]), self.segment_path(s))
        self.sizes[s] = size
        self.writer.reset(s, size, crc)

    def index(self, positions: np.ndarray) -> None:
        """Each row's slot as ``positions`` (``(rows,)`` int64 >= 0: a snapshot's index) says."""
        self.positions[:] = positions
        self.live[:] = np.bincount(positions // self.segment, minlength=self.live.shape[0])
        live = np.bincount(positions, minlength=self.live_bits.shape[0] * 8) > 0  # (unique: a slot a row)
        self.live_bits[:] = np.packbits(live, bitorder="little")

    def _append(self, rows: np.ndarray, records: np.ndarray) -> None:
        """``records`` (``(n, record_bytes)``) as the records of the unique ``rows``, written in
        order into the current segment and the next ones (through a staging buffer of the writer's
        pool, :meth:`SegmentWriter.buffer`: each slot's row header, then its record)."""
        n = rows.shape[0]
        buf = self.writer.buffer(n)
        buf[:n, : self.HEADER] = np.ascontiguousarray(rows).view(np.uint8).reshape(n, self.HEADER)
        buf[:n, self.HEADER :] = records
        self._append_slots(rows, buf[:n], buf)

    def _append_slots(self, rows: np.ndarray, slots: np.ndarray, buffer: np.ndarray | None = None,
                      stream: int = 0) -> None:
        """As :meth:`_append`, the records already in slots (``(n, slot_bytes)``, row headers
        first); ``buffer``: the writer's buffer they are in (back to its pool once written);
        ``stream``: 0 write-backs, 1 the cleaner's moves."""
        n, done, handed = rows.shape[0], 0, buffer is None
        try:
            while done < n:
                if self._tail_used[stream] == self.segment:
                    self._tail[stream], self._tail_used[stream] = self._next_segment(), 0
                tail = self._tail[stream]
                k = min(n - done, self.segment - self._tail_used[stream])
                first = tail * self.segment + self._tail_used[stream]
                last = done + k == n
                self._write(tail, slots[done : done + k], rows[done : done + k], buffer if last else None)
                handed = handed or last
                # their previous records become garbage; the rows point at the new slots (one compiled pass)
                io_kernels().relocate(rows[done : done + k], self.positions, self.live, self.live_bits, self.segment,
                                      self.shift, first)
                self.live[tail] += k
                self._tail_used[stream] += k
                done += k
        finally:
            if not handed:  # (the pool keeps its count; pieces in flight keep this buffer alive until written)
                self.writer.give_back(np.empty((0, self.slot_bytes), np.uint8))

    def _next_segment(self) -> int:
        """A segment to append to, with a new file: a free one, else (once the store is
        ``GC_RATIO`` times its live slots) the one the cleaner empties, else a new one at the end."""
        if not self._free and not self._cleaning and \
                (self.live.shape[0] + 1) * self.segment > self.GC_RATIO * max(self.rows, self.segment):
            # each cleaning frees a segment and fills part of one with what it moves: clean until two
            # are free, so that the moved records land in freed segments rather than new ones
            while len(self._free) < 2 and self._clean():
                pass
        s = self._free.pop() if self._free else self._grow()
        self._open(s)
        return s

    def _clean(self) -> bool:
        """Empty the segment with the fewest live records: read it, append its live records,
        delete its file. ``False`` when every segment is full (the store grows instead)."""
        candidates = self.live.copy()
        candidates[[t for t in self._tail if t >= 0]] = self.segment + 1  # (the current segments are being filled)
        candidates[self._free] = self.segment + 1
        victim = int(np.argmin(candidates))
        if candidates[victim] >= self.segment:
            return False
        if self.writer.written[victim] < self.sizes[victim]:
            self.writer.drain()  # (its records are read back from its file)
        count = int(self.sizes[victim]) // self.slot_bytes
        keep = io_kernels().live_slots(self.live_bits, victim * self.segment, count)
        assert keep.shape[0] == self.live[victim], (victim, keep.shape[0], self.live[victim])
        slots = self.maps.slots(victim, count, self.slot_bytes)  # (a view of its mapping; else read whole)
        if slots is None:
            slots = np.empty((count, self.slot_bytes), np.uint8)
            try:
                got = os.preadv(int(self.fds[victim]), [slots], 0)
            except OSError as e:
                raise self._error(e, "reading", -1, victim) from None
            if got < slots.nbytes:
                raise OSError(f"{self.segment_path(victim)} is shorter than its {count} slots (the store is damaged)")
        n, moved = keep.shape[0], self.writer.buffer(keep.shape[0])  # (pooled: no fresh pages a cleaning)
        io_kernels().take_slots(slots, keep, moved[:n])  # then free it before the move, which may need its space
        self.generation[victim] += 1  # (before it is reused: records staged from it are then refused)
        self._drop(victim)
        self._free.append(victim)
        self._cleaning = True
        try:  # (the live slots as they are, headers and records)
            self._append_slots(np.ascontiguousarray(moved[:n, : self.HEADER]).view(np.int64).reshape(-1), moved[:n],
                               moved, stream=1)
        finally:
            self._cleaning = False
        self.cleaned += 1
        return True

    def _drop(self, s: int) -> None:
        """Let segment ``s``'s file go: kept open to be written again (:meth:`_open`) where this store made it and no
        snapshot links it; else closed and deleted (a checkpoint's link to it keeps its bytes, never written again)."""
        if self._owned[s] and os.fstat(int(self.fds[s])).st_nlink == 1:
            return
        self.maps.unmap(s)
        os.close(int(self.fds[s]))
        self.fds[s] = -1
        self._owned[s] = False
        self._reused.discard(s)
        self.segment_path(s).unlink()
        self._unsynced.discard(s)

    def _write(self, s: int, slots: np.ndarray, rows: np.ndarray, buffer: np.ndarray | None) -> None:
        """Append ``slots`` to segment ``s``'s file on the writer thread (a read waits for its bytes)."""
        at = int(self.sizes[s])
        self.sizes[s] = at + slots.shape[0] * self.slot_bytes
        self._unsynced.add(s)
        self.writer.submit(s, int(self.fds[s]), at, slots, rows, buffer)

    def _error(self, e: OSError, what: str, row: int, s: int) -> OSError:
        return io_error(e, what, self.segment_path(s), row)

    def read(self, rows: np.ndarray, out: np.ndarray, slots: np.ndarray | None = None) -> None:
        """The current records of ``rows`` (int64) into ``out`` (``(len(rows), record_bytes)`` uint8, C order),
        over the I/O threads. ``slots``: read these store slots instead of the rows' current ones (:meth:`stage`)."""
        n = rows.shape[0]  # (not inside the assert: python -O drops it)
        assert out.shape == (n, self.layout.nbytes) and out.dtype == np.uint8 and out.flags.c_contiguous
        whole = np.array([self.layout.nbytes], np.int64)
        self._gather(rows, self.positions[rows] if slots is None else slots, np.arange(n, dtype=np.int64),
                     np.array([out.ctypes.data], np.int64), whole, whole, np.zeros(1, np.int64))

    def _gather(self, rows: np.ndarray, at: np.ndarray, to: np.ndarray, dst: np.ndarray, strides: np.ndarray,
                widths: np.ndarray, offsets: np.ndarray, staging: bool = False) -> None:
        """Records in store slots ``at`` (of ``rows``) into rows ``to`` of the destinations
        (:func:`hetero.storage._kernels.gather`): copies bound by memory on numba's pool where every file is
        mapped, else on the I/O threads (a read in flight each); ``staging``: on the prefetch worker
        (:meth:`stage`, which holds the mappings' lock)."""
        if (n := rows.shape[0]) == 0:
            return
        kernels = io_kernels()

        def run(lo: int, arrays: tuple) -> int:
            scratch = np.empty(self.layout.nbytes, np.uint8)  # (a record read with pread lands here first)
            return kernels.gather(*arrays, self.segment, self.slot_bytes, self.HEADER, at, to, dst, strides, widths,
                                  offsets, scratch, lo, min(lo + chunk, n))

        for attempt in range(2):
            arrays = (bases, fds, _) = (self.maps.bases, self.fds, np.array(self.writer.written, np.int64))
            # (over their common length: a stager may see the owner half way through growing them)
            mapped = not np.any((bases[: fds.shape[0]] == 0) & (fds[: bases.shape[0]] >= 0))
            chunk = max(MIN_CHUNK, -(-n // (CHUNKS_PER_CORE * num_threads() if mapped else self.threads)))
            starts = range(0, n, chunk)
            if mapped and n > chunk:
                stops = kernels.gather_chunks(*arrays, self.segment, self.slot_bytes, self.HEADER, at, to, dst, strides,
                                              widths, offsets, chunk)
            else:
                stops = map(run, starts, [arrays] * len(starts)) if n <= chunk else \
                    self._pool.map(run, starts, [arrays] * len(starts))
            failed = [(lo, stop) for lo, stop in zip(starts, stops) if stop < min(lo + chunk, n)]
            if not failed:
                return
            lo, stop = failed[0]
            if attempt == 0 and not staging:  # (the writer may not have got there yet: wait, then the chunks again)
                self.writer.drain()
                continue
            s, where = int(at[stop]) // self.segment, int(at[stop]) % self.segment * self.slot_bytes + self.HEADER
            if 0 <= s < self.fds.shape[0] and self.fds[s] >= 0 and not self.maps.bases[s]:  # (a pread: its errno)
                try:
                    os.preadv(int(self.fds[s]), [np.empty(self.layout.nbytes, np.uint8)], where)
                except OSError as e:
                    raise self._error(e, "reading", int(rows[stop]), s) from None
            raise OSError(f"reading record {int(rows[stop])} in {self.segment_path(s)}: its slot {int(at[stop])} is "
                          f"not a written one (the store is damaged)")

    def write(self, rows: np.ndarray, records: np.ndarray) -> None:
        """``records`` (``(len(rows), record_bytes)`` uint8) as the new records of the unique
        ``rows`` (appended; not yet durable: :meth:`seal`)."""
        for lo in range(0, rows.shape[0], APPEND_CHUNK):  # (in pieces: the staging of one piece is kept for the next)
            self._append(rows[lo : lo + APPEND_CHUNK], records[lo : lo + APPEND_CHUNK])

    def stage(self, rows: np.ndarray) -> StagedRecords:
        """Read the current records of ``rows`` (unique int64) ahead of their use, from any thread
        while the owner goes on (see :class:`StagedRecords`). A row whose record the writer has not
        written yet is left out, and a read that fails (a slot the owner freed meanwhile) stages
        nothing: the owner reads those rows itself."""
        rows = np.sort(rows)
        whole = np.array([self.layout.nbytes], np.int64)
        with self.maps.lock:  # (no mapping goes away, and no file is cut short, while it copies)
            at = self.positions[rows]  # (the slots first, then their generations: a slot moved meanwhile is refused)
            written = np.array(self.writer.written, np.int64)
            seg = np.minimum(at // self.segment, written.shape[0] - 1)
            ready = (at >= 0) & ((at - seg * self.segment + 1) * self.slot_bytes <= written[seg])
            rows, at = rows[ready], at[ready]
            generations = self.generation[at // self.segment]
            records = np.empty((rows.shape[0], self.layout.nbytes), np.uint8)
            try:
                self._gather(rows, at, np.arange(rows.shape[0], dtype=np.int64), np.array([records.ctypes.data], np.int64),
                             whole, whole, np.zeros(1, np.int64), staging=True)
            except OSError:
                rows = at = generations = np.zeros(0, np.int64)
                records = records[:0]
        return StagedRecords(self, rows, at, generations, records)

    def load(self, rows: np.ndarray, slots: np.ndarray, fields: tuple[np.ndarray, ...], offsets: np.ndarray,
             staged: StagedRecords | None = None) -> int:
        """The records of ``rows`` into slots ``slots`` of ``fields`` (the cache's fields as
        ``(capacity, bytes)`` uint8; field ``k`` at record byte ``offsets[k]``): from ``staged``
        where it holds a row's current record, else read now. Returns how many came from ``staged``."""
        fresh = np.zeros(rows.shape[0], np.bool_)
        if staged is not None and staged.file is self and staged.rows.shape[0]:
            i = np.minimum(np.searchsorted(staged.rows, rows), staged.rows.shape[0] - 1)
            at = staged.slots[i]
            fresh = (staged.rows[i] == rows) & (self.positions[rows] == at) & \
                (self.generation[at // self.segment] == staged.generations[i])
            if fresh.any():
                io_kernels().unpack(staged.records[i[fresh]], slots[fresh], fields, offsets)
        staged_here = int(np.count_nonzero(fresh))
        if staged_here < rows.shape[0]:  # straight from the mapped files into the cache's slots: one copy a field
            if staged_here:  # (else every row: no index arrays to build, 65k rows a step on the tier)
                rest = np.flatnonzero(~fresh)
                rows, slots = rows[rest], slots[rest]
            at, widths = io_kernels().take(self.positions, rows), np.array([f.shape[1] for f in fields], np.int64)
            self._gather(rows, at, slots, np.array([f.ctypes.data for f in fields], np.int64),
                         np.array([f.strides[0] for f in fields], np.int64), widths, offsets.astype(np.int64))
        return staged_here

    def store(self, rows: np.ndarray, slots: np.ndarray, fields: tuple[np.ndarray, ...], offsets: np.ndarray) -> None:
        """The reverse of :meth:`load`: the slots' records as the rows' new records (appended)."""
        for lo in range(0, rows.shape[0], APPEND_CHUNK):  # (packed straight into the staging, in pieces)
            part = np.ascontiguousarray(rows[lo : lo + APPEND_CHUNK])
            buf = self.writer.buffer(part.shape[0])  # (the row headers written by the pack too)
            io_kernels().pack(buf[: part.shape[0]], slots[lo : lo + APPEND_CHUNK], fields, offsets,
                              part.view(np.uint8).reshape(part.shape[0], self.HEADER))
            self._append_slots(part, buf[: part.shape[0]], buf)

    def seal(self) -> None:
        """Make the writes so far durable (``fsync`` of every segment written since the last seal)
        and end the current segment: later appends open a new one, so no file the store holds now
        is written again (the cleaner may delete one)."""
        self.writer.drain()  # (raises a write that failed)
        with self.maps.lock:  # (a file written again from its start ends where its writes did)
            for s in sorted(self._reused):
                os.ftruncate(int(self.fds[s]), int(self.sizes[s]))
            self._reused.clear()
        for s in sorted(self._unsynced):
            os.fsync(int(self.fds[s]))
        self._unsynced.clear()
        self._tail_used = [self.segment, self.segment]
        fsync_path(self.path)  # the directory: its new and deleted entries durable too

    def close(self) -> None:
        self.writer.close()
        self._pool.shutdown()
        self.maps.close()
        for fd in self.fds[self.fds >= 0]:
            os.close(int(fd))
        self.fds[:] = -1
