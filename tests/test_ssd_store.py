"""The SSD tier's record store (hetero.storage.records, .mapping): reads copy records out of the
mapped segment files (up to a budget; the others with pread), a freed segment's own file is written
again where no snapshot links it, and a failed write is one line. Each against plain Python over the same
writes, or the process's own counts (/proc/self/status)."""

import errno
import os
import re

import numpy as np
import pytest
import torch

from hetero.storage import snapshot
from hetero.storage.layout import Field, RecordLayout
from hetero.storage.records import RowFile

ROWS, WIDTH = 256, 8  # 32-byte records; segments of 64 slots: 4 hold the rows, the cleaner runs past 5


def _churn(file, rng, expected, writes=40):
    for _ in range(writes):
        rows = np.unique(rng.integers(0, ROWS, 48)).astype(np.int64)
        values = rng.standard_normal((rows.shape[0], WIDTH)).astype(np.float32)
        file.write(rows, values.view(np.uint8))
        expected[rows] = values


def _read_all(file):
    out = np.empty((ROWS, WIDTH * 4), np.uint8)
    file.read(np.arange(ROWS, dtype=np.int64), out)
    return out.view(np.float32)


def _inodes(file):
    return {s: os.stat(file.segment_path(s)).st_ino for s in range(file.live.shape[0]) if file.fds[s] >= 0}


@pytest.mark.parametrize("mapped_segments", [100, 2])  # (2: most segments are read with pread)
def test_a_freed_segment_is_written_again_in_place_unless_a_snapshot_links_it(tmp_path, mapped_segments):
    rng = np.random.default_rng(0)
    expected = np.zeros((ROWS, WIDTH), np.float32)
    file = RowFile(tmp_path / "s", RecordLayout((Field("w", torch.float32, WIDTH),)), ROWS, threads=2, segment=64,
                   mapped_bytes=mapped_segments * 64 * (8 + 4 * WIDTH))
    _churn(file, rng, expected)
    assert file.cleaned > 0  # (the store is at its size: the cleaner frees segments)
    before, cleaned = _inodes(file), file.cleaned
    _churn(file, rng, expected)
    assert file.cleaned > cleaned and _inodes(file) == before  # freed and written again: the same files
    assert np.array_equal(_read_all(file), expected)
    # a snapshot links the segments: none of them is written again, the snapshot stays as it was
    snapshot.write(file, tmp_path / "snap")
    linked = {s: ino for s, ino in _inodes(file).items() if file.live[s] > 0}
    _churn(file, rng, expected, writes=80)
    assert all(ino not in _inodes(file).values() for ino in linked.values())  # (let go of, never reused)
    snapshot.verify(tmp_path / "snap")
    assert np.array_equal(_read_all(file), expected)
    file.close()


def test_a_slot_the_store_never_wrote_is_refused_naming_the_file(tmp_path):
    file = RowFile(tmp_path / "s", RecordLayout((Field("w", torch.float32, WIDTH),)), ROWS, threads=2, segment=64)
    file.write(np.array([3], np.int64), np.ones((1, WIDTH), np.float32).view(np.uint8))  # (a new segment: 1 slot)
    tail = file.positions[3] // file.segment
    file.positions[3] += 5  # past what the segment's file holds
    with pytest.raises(OSError, match=rf"reading record 3 in .*{tail:06d}\.seg: its slot \d+ is not a written one"):
        _read_all(file)
    file.close()


def _rss_file_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


@pytest.mark.parametrize("budget_mib,bounded", [(4, True), (1024, False)])
def test_segments_are_mapped_up_to_the_budget_and_the_rest_read_with_pread(tmp_path, budget_mib, bounded):
    # 64 MiB of 4 KiB records, every one read twice: the mapped segments' pages stay mapped (counted in
    # RssFile), the others are read into the page cache only; with a budget above the store, all are
    # mapped (the check that the count can fail)
    rows, width = 1 << 14, 1024
    file = RowFile(tmp_path / "s", RecordLayout((Field("w", torch.float32, width),)), rows, threads=2,
                   init=lambda lo, hi: np.zeros((hi - lo, 4 * width), np.uint8), mapped_bytes=budget_mib << 20)
    out = np.empty((1024, 4 * width), np.uint8)
    before = _rss_file_kib()
    grew = 0
    for _ in range(2):
        for lo in range(0, rows, 1024):
            file.read(np.arange(lo, lo + 1024, dtype=np.int64), out)
            grew = max(grew, _rss_file_kib() - before)
            assert not out.any()  # (the zeros written, through either path)
    if bounded:
        assert grew < 3 * budget_mib * 1024, grew  # (the budget, give or take the last read's pages)
    else:
        assert grew > 48 * 1024, grew
    file.close()


@pytest.mark.parametrize("err,fix", [(errno.EIO, "check the disk"), (errno.ENOSPC, "free space there")])
def test_a_failed_write_back_stops_training_with_one_line_and_the_last_checkpoint_loads(tmp_path, monkeypatch, err, fix):
    from test_ssd_checkpoint import _group, _ssd
    from test_ssd_tier import _batches, _train

    ssd, opt = _ssd(tmp_path, "run")
    _train(ssd, opt, _batches(5))
    _group(ssd).ssd_checkpoint(tmp_path / "ok")

    def refused(fd, data, offset):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "pwrite", refused)  # (the writer thread's write-backs from here on)
    with pytest.raises(OSError) as raised:
        _train(ssd, opt, _batches(20))
        _group(ssd).ssd_checkpoint(tmp_path / "failed")
    line = str(raised.value)
    assert "\n" not in line and re.search(rf"writing record \d+ in {re.escape(str(tmp_path))}.*\.seg failed: "
                                          rf"{os.strerror(err)}; {fix}", line), line
    monkeypatch.undo()
    assert not (tmp_path / "failed" / "manifest.json").exists()
    snapshot.verify(tmp_path / "ok")


def test_the_cleaners_scan_finds_exactly_the_live_slots_of_any_range():
    """``live_slots`` (a byte of bits at a time, from a table) against a plain loop over the bits,
    for ranges starting and ending inside a byte, all-live and all-dead bytes included."""
    from hetero.storage.layout import io_kernels

    rng = np.random.default_rng(1)
    for trial in range(300):
        nbytes = int(rng.integers(1, 40))
        bits = rng.integers(0, 256, nbytes).astype(np.uint8)
        if trial % 3 == 0:
            bits[rng.integers(0, nbytes)] = 255
        if trial % 5 == 0:
            bits[:] = 0
        first = int(rng.integers(0, nbytes * 8))
        count = int(rng.integers(0, nbytes * 8 - first + 1))
        want = [i for i in range(count) if bits[(first + i) >> 3] >> ((first + i) & 7) & 1]
        assert io_kernels().live_slots(bits, first, count).tolist() == want, (first, count)


def test_a_read_ahead_while_the_owner_grows_the_store_reads_what_is_there(tmp_path):
    """The prefetch worker's :meth:`RowFile.stage` runs while the owner may be half way through
    adding a segment (its file descriptors grown, its mappings not yet): the read ahead still
    reads every record (it raised a broadcast ``ValueError`` once, from CI)."""
    file = RowFile(tmp_path / "s", RecordLayout((Field("w", torch.float32, WIDTH),)), ROWS, threads=2, segment=64,
                   init=lambda lo, hi: np.arange(lo, hi, dtype=np.float32).repeat(WIDTH).reshape(hi - lo, WIDTH)
                   .view(np.uint8))
    file.fds = np.append(file.fds, np.int32(-1))  # (the first step of RowFile._grow, on the owner's thread)
    rows = np.arange(0, ROWS, 3, dtype=np.int64)
    staged = file.stage(rows)
    assert np.array_equal(staged.rows, rows)
    assert np.array_equal(staged.records.view(np.float32)[:, 0], rows.astype(np.float32))
    file.fds = file.fds[:-1]
    file.close()
