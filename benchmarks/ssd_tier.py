"""The SSD tier against host memory (issue #37): the embedding step of a Criteo-shaped job - 26
tables of ``--rows`` rows x ``--dim`` fp32 trained by row-wise Adagrad, batches of 4096 samples -
with the tables in memory, and on the SSD tier under a row cache of ``--cache`` of the rows, on
Zipf(1.05) ids and on uniform ids; the cache's two policies on the skewed ids; and the disk's own
4 KiB random-read rate at queue depth 1 and 32 (``disk_rate.py``'s plain read loop), beside the
tier's miss reads per second.

Each case runs in a fresh process (its peak resident memory, ``ru_maxrss``, is its own). The
headline ratios (``ssd_over_memory_*``) come from one more process that holds both and times a
step of each in turn (``interleaved``): this VM's speed moves by up to half between processes.
The tier is timed once its cache is full (it has given up rows), after the warm-up steps. The step
is forward + backward (a fixed upstream gradient) + the optimizer step: the part of a training
step the tier changes. The whole training step of a job over the same tables - a DLRM of the
Criteo Kaggle shape with its dense features, MLPs and Adam (``job``, ``job_ssd_over_memory_*``) -
is timed the same way, its tables in memory, on the tier, and on the tier with the next batch's
misses read ahead by :class:`hetero.embedding.Prefetcher`; with ``--job-processes`` in pairs of
fresh processes instead, the tables on the tier and in memory (tables too large for one process to
hold both ways, such as the issue's 26 x 4M rows). What the page cache holds is reported
beside the rates: a row file smaller than free memory is served from it after its first pass (the
tier then measures its own cost, not the disk's); the disk-bound case is a file larger than memory
(``--rows`` large enough).

    python benchmarks/ssd_tier.py --rows 1000000 --dir /path/on/the/disk
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu, emit  # noqa: E402
from _workload import in_turn  # noqa: E402

from hetero.placement.memory import retain_freed_memory  # noqa: E402

B, F = 4096, 26
BLOCK = 5  # steps a block of the interleaved ratio


def batches(dist: str, rows: int, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of fresh draws (``seed``) from one distribution: Zipf's ranks map to rows by one
    permutation whatever the seed (the rows' popularity stays; before 2026-11-29 each seed permuted anew,
    so the cache filled under other hot rows than the timed steps had)."""
    perm = np.random.default_rng(0).permutation(rows)
    rng = np.random.default_rng(seed)
    if seed == 0:
        rng.permutation(rows)  # (seed 0's draws as before: they followed its permutation)
    out = []
    for _ in range(count):
        ids = rng.integers(0, rows, (B, F)) if dist == "uniform" else perm[(rng.zipf(1.05, (B, F)) - 1) % rows]
        out.append({f"C{i}": torch.from_numpy(np.ascontiguousarray(ids[:, i])) for i in range(F)})
    return out


@dataclasses.dataclass
class Tables:
    """The 26 tables (``coll``) and their optimizer; calling it trains one batch."""

    coll: Any
    opt: Any
    upstream: torch.Tensor

    def __call__(self, feats: dict[str, torch.Tensor]) -> None:
        self.opt.zero_grad()
        out = self.coll(feats)
        torch.autograd.backward(list(out.values()), [self.upstream] * F)
        self.opt.step()

    @property
    def row_cache(self):  # noqa: ANN201 - the tier's RowCache
        """The tier's row cache (made at the first lookup), ``None`` in memory."""
        ssd = self.coll.groups[0].ssd
        return ssd.cache if ssd is not None else None


def build(storage: str, policy: str, rows: int, dim: int, cache: float, directory: str, mapped_gib: float = 1.0) -> Tables:
    """The 26 tables in memory or on the SSD tier, and their optimizer."""
    from hetero.embedding import HostEmbeddingCollection, TableConfig
    from hetero.optim import SparseOptimizerKind
    from hetero.placement import StorageTier

    torch.manual_seed(0)
    kw = {}
    if storage.startswith("ssd"):
        kw = dict(storage=StorageTier.SSD, ssd=tier_config(directory, policy, rows, dim, cache, mapped_gib))
    coll = HostEmbeddingCollection([TableConfig(f"C{i}", rows, dim, **kw) for i in range(F)])
    opt = SparseOptimizerKind.ROWWISE_ADAGRAD.optimizer(coll.tables.values())
    return Tables(coll, opt, torch.randn(B, dim))


def fill(step, cache_obj, dist: str, rows: int) -> int:
    """Steps to the tier's steady state: a full cache, and a store at its size whose cleaner has
    emptied as many segments as the store holds (one turnover: the first segments it cleans are
    nearly empty, and a store just at its size cleans fewer a step than a long run's)."""
    filled = 0
    while cache_obj is not None and (cache_obj.stats.evictions == 0 or cache_obj.file.cleaned < cache_obj.file.live.shape[0]) \
            and filled < 2000:
        for b in batches(dist, rows, 10, seed=1 + filled):
            step(b)
        filled += 10
    return filled


def one(storage: str, dist: str, policy: str, rows: int, dim: int, cache: float, steps: int, warmup: int,
        directory: str, mapped_gib: float = 1.0) -> dict:
    """One case in this process: samples/s and the tier's counts."""
    t0 = time.perf_counter()
    step = build(storage, policy, rows, dim, cache, directory, mapped_gib)
    built = time.perf_counter() - t0
    prefetch = storage == "ssd_prefetch"  # the next batch's misses read ahead on the prefetch worker
    work = batches(dist, rows, warmup + steps)
    for b in work[:warmup]:
        step(b)
    cache_obj = step.row_cache
    filled = fill(step, cache_obj, dist, rows)
    before = dataclass_counts(cache_obj)
    t0 = time.perf_counter()
    from hetero.embedding import Prefetcher

    for b in (Prefetcher(step.coll, work[warmup:], features=lambda b: b) if prefetch else work[warmup:]):
        step(b)
    seconds = time.perf_counter() - t0
    after = dataclass_counts(cache_obj)
    out = {"samples_per_s": B * steps / seconds, "build_s": built, "fill_steps": filled,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if cache_obj is not None:
        hits, misses = after[0] - before[0], after[1] - before[1]
        out["read_ahead"] = (after[4] - before[4]) / max(1, misses)  # of the misses, read on the prefetch worker
        out.update(hit_rate=hits / max(1, hits + misses), miss_reads_per_s=misses / seconds,
                   write_backs_per_s=(after[3] - before[3]) / seconds, cache_rows=cache_obj.capacity,
                   cache_bytes=cache_obj.nbytes, file_bytes=cache_obj.file.nbytes, segments_cleaned=cache_obj.file.cleaned,
                   logical_bytes=rows * F * record_bytes(dim))
    return out


def interleaved(dist: str, policy: str, rows: int, dim: int, cache: float, steps: int, warmup: int,
                directory: str, mapped_gib: float = 1.0) -> dict:
    """The same-process ratio: the tables in memory and on the tier side by side in this process,
    trained on the same batches in blocks of ``BLOCK`` steps, one block of each in turn (which one
    first alternates): this VM's speed moves by up to half between processes, and here each block
    sees the machine the other saw. A tier's block ends when its writer thread has written all
    it was handed (its background work is its own, not the next block's)."""
    memory = build("memory", policy, rows, dim, cache, directory, mapped_gib)
    tier = build("ssd", policy, rows, dim, cache, directory, mapped_gib)
    work = batches(dist, rows, warmup + steps)
    for b in work[:warmup]:
        memory(b)
        tier(b)
    fill(tier, tier.row_cache, dist, rows)
    writer = tier.row_cache.file.writer
    writer.drain()

    def on_tier(part: list) -> None:
        for b in part:
            tier(b)
        writer.drain()  # (the tier's background work is its block's own)

    parts = [work[lo : lo + BLOCK] for lo in range(warmup, warmup + steps, BLOCK)]
    seconds = in_turn({"memory": lambda part: [memory(b) for b in part], "ssd": on_tier}, parts)
    rate = {k: B / v for k, v in seconds.items()}
    return {"memory_samples_per_s": rate["memory"], "ssd_samples_per_s": rate["ssd"],
            "ssd_over_memory": rate["ssd"] / rate["memory"], "steps": steps, "block": BLOCK}


def dense_features():
    """``with_dense(feats)``: a batch of the job, its ids with seeded dense features and labels."""
    from dlrm_step import K  # (the DLRM's dense features)

    g = torch.Generator().manual_seed(1)

    def with_dense(feats: dict) -> tuple:
        return feats, torch.randn(B, K, generator=g), torch.randint(0, 2, (B,), generator=g).float()

    return with_dense


def tier_config(directory: str | Path, policy: str, rows: int, dim: int, cache: float, mapped_gib: float):
    """The 26 tables' SSD tier in ``directory``: a row cache of ``cache`` of the rows, ``mapped_gib`` of the store
    mapped."""
    from hetero.storage.cache import CachePolicy
    from hetero.storage.config import SsdConfig

    return SsdConfig(directory, policy=CachePolicy(policy), cache_bytes=int(cache * rows * F * record_bytes(dim)),
                     mapped_bytes=int(mapped_gib * (1 << 30)))


def job(dist: str, policy: str, rows: int, dim: int, cache: float, steps: int, warmup: int, directory: str,
        mapped_gib: float = 1.0) -> dict:
    """The same-process ratio of the whole training step of a Criteo-shaped job: ``dlrm_step.py``'s DLRM (13 dense
    features, bottom MLP 512-256-64-``dim``, dot interaction, top MLP 512-256-1, Adam) over the 26 tables
    (row-wise Adagrad), its tables in memory, on the SSD tier, and on the tier under :class:`Prefetcher` (the next
    batch's misses read on the prefetch worker while this batch's dense step runs); blocks in turn as
    :func:`interleaved`. What a user of the tier sees: the tables' extra work beside the model's own."""
    from dlrm_step import build as build_job  # (the DLRM of the DLRM step benchmark)

    from hetero.embedding import Prefetcher

    with_dense = dense_features()
    _, memory = build_job(rows, False, dim)
    work = [with_dense(b) for b in batches(dist, rows, warmup + steps)]
    tiers = {}  # a tier each for the two ways (each sees every batch once: a batch seen twice would find its rows)
    for name in ("ssd", "ssd_prefetch"):
        model, tier = build_job(rows, False, dim, tier_config(Path(directory) / name, policy, rows, dim, cache, mapped_gib))
        for b in work[:warmup]:
            tier(b)
        row_cache = model.deep.groups[0].ssd.cache
        fill(lambda b, tier=tier: tier(with_dense(b)), row_cache, dist, rows)
        row_cache.file.writer.drain()
        tiers[name] = (model, tier, row_cache, dataclass_counts(row_cache))
    for b in work[:warmup]:
        memory(b)

    def on_tier(part: list, name: str) -> None:
        model, tier, row_cache, _ = tiers[name]
        for b in (Prefetcher(model, part, features=lambda b: b[0]) if name == "ssd_prefetch" else part):
            tier(b)
        row_cache.file.writer.drain()  # (the tier's background work is its block's own)

    parts = [work[lo : lo + BLOCK] for lo in range(warmup, warmup + steps, BLOCK)]
    seconds = in_turn({"memory": lambda part: [memory(b) for b in part], "ssd": lambda part: on_tier(part, "ssd"),
                       "ssd_prefetch": lambda part: on_tier(part, "ssd_prefetch")}, parts)
    rate = {k: B / v for k, v in seconds.items()}
    counts = {}
    for name, (_, _, row_cache, before) in tiers.items():
        after = dataclass_counts(row_cache)
        hits, misses = after[0] - before[0], after[1] - before[1]
        counts[name] = {"hit_rate": hits / max(1, hits + misses), "read_ahead": (after[4] - before[4]) / max(1, misses)}
    return {"memory_samples_per_s": rate["memory"], "ssd_samples_per_s": rate["ssd"],
            "ssd_prefetch_samples_per_s": rate["ssd_prefetch"], "ssd_over_memory": rate["ssd"] / rate["memory"],
            "ssd_prefetch_over_memory": rate["ssd_prefetch"] / rate["memory"], **counts,
            "model": f"dlrm 13-512-256-64-{dim}, top 512-256-1, adam", "steps": steps, "block": BLOCK}


def job_one(storage: str, dist: str, policy: str, rows: int, dim: int, cache: float, steps: int, warmup: int,
            directory: str, mapped_gib: float = 1.0) -> dict:
    """The job's step with its tables in memory or on the tier (``storage``) alone in this process: for tables too
    large to hold both ways in one process (the issue's 26 x 4M rows), in fresh processes taken in turn."""
    from dlrm_step import build as build_job

    with_dense = dense_features()
    ssd = tier_config(Path(directory) / "tier", policy, rows, dim, cache, mapped_gib) if storage == "ssd" else None
    t0 = time.perf_counter()
    model, step = build_job(rows, False, dim, ssd)
    built = time.perf_counter() - t0
    work = [with_dense(b) for b in batches(dist, rows, warmup + steps)]
    for b in work[:warmup]:
        step(b)
    row_cache = model.deep.groups[0].ssd.cache if ssd is not None else None
    filled = fill(lambda b: step(with_dense(b)), row_cache, dist, rows)
    if row_cache is not None:
        row_cache.file.writer.drain()
    before = dataclass_counts(row_cache)
    t0 = time.perf_counter()
    for b in work[warmup:]:
        step(b)
    if row_cache is not None:
        row_cache.file.writer.drain()  # (the tier's background work is its steps' own)
    seconds = time.perf_counter() - t0
    after = dataclass_counts(row_cache)
    hits, misses = after[0] - before[0], after[1] - before[1]
    out = {"samples_per_s": B * steps / seconds, "build_s": built, "fill_steps": filled, "steps": steps,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if row_cache is not None:
        out.update(hit_rate=hits / max(1, hits + misses), miss_reads_per_s=misses / seconds,
                   file_bytes=row_cache.file.nbytes, segments_cleaned=row_cache.file.cleaned)
    return out


def record_bytes(dim: int) -> int:
    return dim * 4 + 4  # the row and row-wise Adagrad's one value


def dataclass_counts(cache) -> tuple[int, int, int, int, int]:
    s = cache.stats if cache is not None else None
    return (s.hits, s.misses, s.evictions, s.write_backs, s.staged) if s else (0, 0, 0, 0, 0)


def case(args, storage: str, dist: str, policy: str = "lfu", env: dict[str, str] | None = None) -> dict:
    """One case in a fresh process; ``env``: variables set for it (both sides of an interleaved case)."""
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        cmd = [sys.executable, __file__, "--one", storage, dist, policy, "--rows", str(args.rows), "--dim", str(args.dim),
               "--cache", str(args.cache), "--steps", str(args.steps), "--warmup", str(args.warmup), "--dir", d,
               "--mapped-gib", str(args.mapped_gib)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, **(env or {})})
        result = json.loads(done.stdout.strip().splitlines()[-1])
    print(storage, dist, policy, env or "", result, file=sys.stderr)
    return result


def disk(args) -> dict:
    from disk_rate import drop_cache, random_reads, write_file

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "probe"
        write_file(path, 1 << 30)
        out = {}
        for depth in (1, 32):
            drop_cache(path)
            out[f"buffered_qd{depth}_reads_per_s"] = random_reads(path, depth, args.seconds, direct=False)
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--cache", type=float, default=0.1, help="the row cache's share of the rows")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seconds", type=float, default=3.0, help="per disk-rate measurement")
    p.add_argument("--dir", default=None, help="a directory on the disk to measure (default: the temp dir)")
    p.add_argument("--name", default="ssd_tier", help="the result's name (results/NAME_cpu.json)")
    p.add_argument("--mapped-gib", type=float, default=1.0,
                   help="the store's pages kept mapped (SsdConfig.mapped_bytes), GiB: the rest read with pread")
    p.add_argument("--ratio-only", action="store_true",
                   help="the same-run ratios alone (the embedding step and the job, both distributions): no LRU, "
                        "separate prefetch cases or disk rate")
    p.add_argument("--job-processes", type=int, default=0, metavar="ROUNDS",
                   help="the job's ratio alone, on Zipf ids, from ROUNDS pairs of fresh processes (the tables on the tier, "
                        "then in memory): for tables too large to hold both ways in one process")
    p.add_argument("--one", nargs=3, metavar=("STORAGE", "DIST", "POLICY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    retain_freed_memory()  # (as the hetero command does: a step's freed buffers are not faulted in again)
    if args.one and args.one[0] in ("job_memory", "job_ssd"):
        print(json.dumps(job_one(args.one[0][4:], *args.one[1:], args.rows, args.dim, args.cache, args.steps,
                                 args.warmup, args.dir, args.mapped_gib)))
        return
    if args.one and args.one[0] in ("interleaved", "job"):
        print(json.dumps((interleaved if args.one[0] == "interleaved" else job)(
            *args.one[1:], args.rows, args.dim, args.cache, args.steps, args.warmup, args.dir, args.mapped_gib)))
        return
    if args.one:
        print(json.dumps(one(*args.one, args.rows, args.dim, args.cache, args.steps, args.warmup, args.dir,
                             args.mapped_gib)))
        return
    result = {"rows_per_table": args.rows, "tables": F, "dim": args.dim, "batch_size": B, "cache_share": args.cache,
              "mapped_gib": args.mapped_gib,
              "optimizer": "rowwise_adagrad", "cpu": cpu(),
              "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    if args.job_processes:  # (each pair's ratio; the headline their median)
        pairs = [(case(args, "job_ssd", "zipf"), case(args, "job_memory", "zipf")) for _ in range(args.job_processes)]
        result["zipf"] = {"job_processes": [{"ssd": s, "memory": m, "ssd_over_memory": s["samples_per_s"] / m["samples_per_s"]}
                                            for s, m in pairs]}
        result["job_ssd_over_memory_zipf"] = float(np.median([p["ssd_over_memory"] for p in result["zipf"]["job_processes"]]))
        emit(args.name, result)
        return
    for dist in ("zipf", "uniform"):
        mem, ssd = case(args, "memory", dist), case(args, "ssd", dist)
        result[dist] = {"memory": mem, "ssd": ssd, "ssd_over_memory": ssd["samples_per_s"] / mem["samples_per_s"]}
    for dist in ("zipf", "uniform"):  # the headline ratios: both in one process, step by step in turn
        result[dist]["interleaved"] = case(args, "interleaved", dist)
    result["ssd_over_memory_zipf"] = result["zipf"]["interleaved"]["ssd_over_memory"]
    result["ssd_over_memory_uniform"] = result["uniform"]["interleaved"]["ssd_over_memory"]
    # the same with OpenMP's idle threads asleep rather than spinning (torch's and numba's pools spin after each
    # parallel region and take the cores the tier's writer and I/O threads need: docs/ssd-tier.md)
    result["zipf"]["interleaved_passive"] = case(args, "interleaved", "zipf", env={"OMP_WAIT_POLICY": "PASSIVE"})
    result["ssd_over_memory_zipf_passive"] = result["zipf"]["interleaved_passive"]["ssd_over_memory"]
    result["hit_rate_zipf_lfu"] = result["zipf"]["ssd"]["hit_rate"]
    for dist in ("zipf", "uniform"):  # the whole training step of a DLRM over the same tables, in turn
        result[dist]["job"] = case(args, "job", dist)
    result["job_ssd_over_memory_zipf"] = result["zipf"]["job"]["ssd_over_memory"]
    result["job_ssd_prefetch_over_memory_zipf"] = result["zipf"]["job"]["ssd_prefetch_over_memory"]
    if not args.ratio_only:
        result["zipf_lru"] = case(args, "ssd", "zipf", "lru")
        for dist in ("zipf", "uniform"):  # the same run with the next batch's misses read ahead
            result[dist]["ssd_prefetch"] = ahead = case(args, "ssd_prefetch", dist)
            result[dist]["ssd_prefetch_over_memory"] = ahead["samples_per_s"] / result[dist]["memory"]["samples_per_s"]
        result["disk"] = disk(args)
        result["ssd_prefetch_over_memory_zipf"] = result["zipf"]["ssd_prefetch_over_memory"]
        result["hit_rate_zipf_lru"] = result["zipf_lru"]["hit_rate"]
    emit(args.name, result)


if __name__ == "__main__":
    main()
