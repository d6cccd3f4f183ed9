"""Tables larger than the machine's memory on the SSD tier (issue #37): 26 tables of ``--rows``
rows x ``--dim`` fp32 with row-wise Adagrad's state (``--rows 2700000 --dim 128``: 36 GB of rows
and state, 1.5x a 24 GiB machine), trained for ``--steps`` steps of ``--batch`` samples on
Zipf(1.05) ids under a row cache of ``--cache-gb``; then a checkpoint (the tier's snapshots,
:mod:`hetero.train.tier`) and, in a fresh process, a resume from it and a few more steps.

Reported: samples/s (after ``--warmup`` steps), the row hit rate and miss reads per second beside
the disk's own 4 KiB random-read rate at queue depth 1 and 32 (``disk_rate.py``), peak resident
memory (``ru_maxrss``) of each process and, while training, the peaks of its two parts (``RssAnon``:
the process's own memory; ``RssFile``: store pages it keeps mapped, page cache, at most about
``SsdConfig.mapped_bytes``), bytes on disk over logical bytes, and the times of the first layout
(the initial rows written), the checkpoint, the resume's check (every snapshot file read against
its CRC-32) and its restore (links). The page cache holds what of the store fits in the rest of
RAM, so part of the misses are served from it (the ``disk`` block says what the disk itself does).

    python benchmarks/ssd_beyond_memory.py --dir /path/on/the/disk
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

F = 26


def _model(args, directory: Path):
    from hetero.embedding import HostEmbeddingCollection, TableConfig
    from hetero.optim import SparseOptimizerKind
    from hetero.placement import StorageTier
    from hetero.storage import SsdConfig

    ssd = SsdConfig(directory, cache_bytes=int(args.cache_gb * (1 << 30)))
    coll = HostEmbeddingCollection([TableConfig(f"C{i}", args.rows, args.dim, storage=StorageTier.SSD, ssd=ssd)
                                    for i in range(F)])
    return coll, SparseOptimizerKind.ROWWISE_ADAGRAD.optimizer(coll.tables.values())


def _steps(coll, opt, args, count: int, seed: int, budget: float) -> tuple[int, float]:
    """``count`` steps (fewer if ``budget`` seconds run out): steps done and their seconds."""
    rng = np.random.default_rng(seed)
    upstream = torch.randn(args.batch, args.dim)
    t0 = time.perf_counter()
    for i in range(count):
        ids = (rng.zipf(1.05, (args.batch, F)) - 1) % args.rows
        opt.zero_grad()
        out = coll({f"C{j}": torch.from_numpy(np.ascontiguousarray(ids[:, j])) for j in range(F)})
        torch.autograd.backward(list(out.values()), [upstream] * F)
        opt.step()
        _sample()
        if time.perf_counter() - t0 > budget:
            return i + 1, time.perf_counter() - t0
    return count, time.perf_counter() - t0


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


PEAKS = {"RssAnon": 0, "RssFile": 0}  # the resident set's parts, their peaks over the steps (bytes)


def _sample() -> None:
    """The process's own memory (``RssAnon``) and the store's pages it keeps mapped (``RssFile``:
    page cache, dropped under pressure) - ``ru_maxrss`` counts both."""
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in PEAKS:
                PEAKS[key] = max(PEAKS[key], int(line.split()[1]) * 1024)


def train(args) -> dict:
    from hetero.train.tier import TierCheckpoint

    coll, opt = _model(args, Path(args.dir) / "store")
    (group,) = coll.groups
    t0 = time.perf_counter()
    group.ssd_rows()  # the first layout: every initial row written
    layout = time.perf_counter() - t0
    _steps(coll, opt, args, args.warmup, 1, 1e9)
    stats, cache = group.ssd.cache.stats, group.ssd.cache
    h0, m0 = stats.hits, stats.misses
    steps, seconds = _steps(coll, opt, args, args.steps, 2, args.max_seconds)
    hits, misses = stats.hits - h0, stats.misses - m0
    tier = TierCheckpoint(coll, Path(args.dir) / "run")
    t0 = time.perf_counter()
    entry = tier.save(tier.new_directory(Path("checkpoint.pt"), steps))
    torch.save({"tier": entry, "optimizer": opt.state_dict(include_state=False)}, Path(args.dir) / "run" / "checkpoint.pt")
    checkpoint = time.perf_counter() - t0
    record = sum(f.nbytes for f in group.ssd.layout.fields)
    logical = args.rows * F * record
    return {"layout_s": layout, "steps": steps, "samples_per_s": steps * args.batch / seconds,
            "hit_rate": hits / max(1, hits + misses), "miss_reads_per_s": misses / seconds,
            "cache_bytes": cache.nbytes, "cache_rows": cache.capacity, "logical_bytes": logical,
            "store_bytes": group.ssd.file.nbytes, "store_over_logical": group.ssd.file.nbytes / logical,
            "store_bytes_on_disk": _du(Path(args.dir) / "store"), "segments_cleaned": group.ssd.file.cleaned,
            "checkpoint_s": checkpoint, "peak_rss_bytes": _rss(), "peak_rss_anon_bytes": PEAKS["RssAnon"],
            "peak_rss_file_bytes": PEAKS["RssFile"]}


def resume(args) -> dict:
    from hetero.train.tier import TierCheckpoint

    t0 = time.perf_counter()
    coll, opt = _model(args, Path(args.dir) / "resumed")
    saved = torch.load(Path(args.dir) / "run" / "checkpoint.pt", weights_only=False)
    tier = TierCheckpoint(coll, Path(args.dir) / "run")
    t1 = time.perf_counter()
    parts = tier.check(saved["tier"], Path(args.dir) / "run" / "checkpoint.pt")  # every file against its CRC-32
    t2 = time.perf_counter()
    tier.restore(parts)
    opt.load_state_dict(saved["optimizer"])
    t3 = time.perf_counter()
    steps, seconds = _steps(coll, opt, args, 20, 3, 1e9)
    return {"build_s": t1 - t0, "check_s": t2 - t1, "restore_s": t3 - t2, "resume_s": t3 - t0,
            "samples_per_s_after": steps * args.batch / seconds, "peak_rss_bytes": _rss()}


def _du(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2_700_000, help="rows per table")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--cache-gb", type=float, default=4.0)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--max-seconds", type=float, default=1800.0, help="the timed steps stop here (steps done are reported)")
    p.add_argument("--seconds", type=float, default=3.0, help="per disk-rate measurement")
    p.add_argument("--dir", default=None, help="a directory on the disk to measure (default: the temp dir)")
    p.add_argument("--name", default="ssd_beyond_memory")
    p.add_argument("--phase", choices=["train", "resume"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        print(json.dumps((train if args.phase == "train" else resume)(args)))
        return
    root = Path(args.dir or "/tmp") / f"beyond-{os.getpid()}"
    # the training store grows to 1.4 times the logical bytes, and the resume lays out the tables once more beside it
    need, free = 2.5 * args.rows * F * (args.dim * 4 + 4), shutil.disk_usage(root.parent).free
    if free < need:
        raise SystemExit(f"{root.parent}: {free / 1e9:.0f} GB free, the run needs about {need / 1e9:.0f} GB (the store "
                         f"and the resume's layout); pass --dir on a larger disk, or fewer --rows")
    root.mkdir(parents=True)
    try:
        common = [sys.executable, __file__, "--rows", str(args.rows), "--dim", str(args.dim), "--cache-gb",
                  str(args.cache_gb), "--batch", str(args.batch), "--steps", str(args.steps), "--warmup",
                  str(args.warmup), "--max-seconds", str(args.max_seconds), "--dir", str(root)]
        result = {"tables": F, "rows_per_table": args.rows, "dim": args.dim, "batch_size": args.batch,
                  "optimizer": "rowwise_adagrad", "ids": "zipf(1.05)", "cache_gb": args.cache_gb,
                  "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
        for phase in ("train", "resume"):
            done = subprocess.run([*common, "--phase", phase], capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{phase} failed:\n{done.stderr[-3000:]}")
            result[phase] = json.loads(done.stdout.strip().splitlines()[-1])
            print(phase, result[phase], file=sys.stderr)
        result["logical_over_ram"] = result["train"]["logical_bytes"] / result["ram_bytes"]
        from disk_rate import drop_cache, random_reads, write_file

        probe = root / "probe"
        write_file(probe, 1 << 30)
        for depth in (1, 32):
            drop_cache(probe)
            result[f"disk_qd{depth}_reads_per_s"] = random_reads(probe, depth, args.seconds, direct=False)
        result["miss_reads_over_qd32"] = result["train"]["miss_reads_per_s"] / result["disk_qd32_reads_per_s"]
        emit(args.name, result)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
