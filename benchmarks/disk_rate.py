"""The local disk's own limits, which an SSD tier of host tables (issue #37) is held to: 4 KiB
random reads per second at queue depth 1 and 32, through the page cache and with ``O_DIRECT``,
and the sequential write rate.

A file of ``--gib`` GiB is written in 8 MiB chunks and fsynced; its pages are then dropped from
the page cache (``posix_fadvise(DONTNEED)``: no root needed), so buffered reads measure the disk,
not memory. Queue depth N is N threads each issuing ``os.preadv`` of one aligned 4 KiB block at
a uniformly random offset (the GIL is released in the system call); ``O_DIRECT`` reads into
page-aligned ``mmap`` buffers. Each measurement runs ``--seconds``; the page cache is dropped
again before each buffered one, and the share of buffered reads that hit a block read earlier
in the same run (served from the cache: uniform draws repeat) is reported beside it.

    python benchmarks/disk_rate.py --gib 4 --seconds 5 --dir /path/on/the/disk
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import random
import tempfile
import threading
import time
from pathlib import Path

from _common import emit

BLOCK = 4096


def write_file(path: Path, nbytes: int) -> float:
    """Write ``nbytes`` of random-looking data sequentially, fsynced; bytes per second."""
    chunk = os.urandom(8 << 20)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
        os.fsync(f.fileno())
    return nbytes / (time.perf_counter() - start)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def random_reads(path: Path, depth: int, seconds: float, direct: bool) -> float:
    """4 KiB reads per second at uniformly random aligned offsets, ``depth`` in flight."""
    blocks = path.stat().st_size // BLOCK
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    counts = [0] * depth
    stop = threading.Event()

    def reader(i: int) -> None:
        fd = os.open(path, flags)
        buf = mmap.mmap(-1, BLOCK)  # page-aligned: what O_DIRECT requires
        rng = random.Random(i)
        try:
            while not stop.is_set():
                for _ in range(64):
                    os.preadv(fd, [buf], rng.randrange(blocks) * BLOCK)
                counts[i] += 64
        finally:
            os.close(fd)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(depth)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="file size (GiB)")
    p.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    p.add_argument("--dir", type=Path, default=None, help="a directory on the disk to measure (default: the temp dir)")
    args = p.parse_args()
    result: dict = {"file_gib": args.gib, "block_bytes": BLOCK}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "blocks.bin"
        result["sequential_write_bytes_per_s"] = write_file(path, int(args.gib * 2**30))
        blocks = path.stat().st_size // BLOCK
        for depth in (1, 32):
            drop_cache(path)
            rate = result[f"buffered_qd{depth}_reads_per_s"] = random_reads(path, depth, args.seconds, direct=False)
            # the share of those reads that found a block read before, in the page cache (uniform draws)
            n = rate * args.seconds
            result[f"buffered_qd{depth}_repeat_fraction"] = 1 - blocks / n * (1 - math.exp(-n / blocks))
            result[f"direct_qd{depth}_reads_per_s"] = random_reads(path, depth, args.seconds, direct=True)
        drop_cache(path)
    result["direct_qd32_over_qd1"] = result["direct_qd32_reads_per_s"] / result["direct_qd1_reads_per_s"]
    result["direct_over_buffered_qd32"] = result["direct_qd32_reads_per_s"] / result["buffered_qd32_reads_per_s"]
    emit("disk_rate", result)


if __name__ == "__main__":
    main()
