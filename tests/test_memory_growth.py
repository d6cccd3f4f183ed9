"""Resident memory stays flat per step in every distributed mode of ``hetero train`` on a
Criteo-shaped job with >= 100 MB of host tables: dp with replicated and row-sharded tables, tp,
ZeRO, pp, the parameter server (its shard in memory, or on the SSD tier) and tables on the SSD
tier (replicated, prefetched, row-sharded), 2 ranks each, and dynamic tables (one process, in memory
on the SSD tier and prefetched, and replicated and row-sharded over 2 ranks); a checkpoint every few steps. A rank that
pickled its tables per view at a checkpoint (the pipeline's gather did: 20 GB, killed) or leaked
per step fails here. Each rank's resident set (``VmRSS``) is sampled after every step, and every
rank's peak (``ru_maxrss``) is compared with its resident set after warm-up; a parameter server,
which has no steps of its own, is sampled by the clock and read at the times its worker's steps ended.
The ranks run with glibc's fixed initial thresholds, so the resident set is what the program holds
(:func:`_fixed_malloc_thresholds`)."""

import json
import os
import resource
import threading
import time
from pathlib import Path

import pytest

from conftest import CPU_RANKS, criteo_lines, free_port, spawn

from hetero.placement.memory import DEFAULT_THRESHOLD, retain_freed_memory

# steps, warm-up steps (two checkpoints), steps between checkpoints: a checkpoint costs more than a
# step (4 s of a row-sharded dynamic job's 43 s at one every 4 steps), so two more after the warm-up
STEPS, WARM, EVERY = 24, 12, 6
BUCKETS = 65536  # 26 deep tables of 65,536 x 16 float32 rows: 109 MB, with LazyAdam's two moments 327 MB


def _job(tmp_path, dynamic=False):
    lines = criteo_lines(2500, seed=3)
    (tmp_path / "criteo.tsv").write_text(lines)
    names = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
    dense = "".join(f'[[schema.dense]]\ncolumn = "I{i}"\ntransform = "log1p"\n' for i in range(1, 14))
    # dynamic: a row per admitted value, at most BUCKETS, evicting by age as values come and go
    # (admission sketches of 1 MiB a table, the capacity's width: the default's 16 MiB made a checkpoint 790 MB)
    rows = f"dynamic = true\ncapacity = {BUCKETS}\nadmit_after = 2\nttl_steps = 2\nsketch_width = {BUCKETS}" \
        if dynamic else f"hash_buckets = {BUCKETS}"
    cats = "".join(f'[[schema.categorical]]\ncolumn = "C{i}"\n{rows}\nrole = "deep"\n' for i in range(1, 27))
    job = tmp_path / "job.toml"
    job.write_text(f'[data]\ndelimiter = "\\t"\nheader = false\ncolumn_names = {json.dumps(names)}\n'
                   f'[schema]\nlabel = {{ column = "label" }}\n{dense}{cats}')
    return job, tmp_path / "criteo.tsv"


def _rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _fixed_malloc_thresholds():
    """Measure what the program holds, not what the allocator keeps: glibc's ``malloc`` with its
    initial thresholds (128 KiB) fixed hands freed memory back as it is freed. The ``hetero``
    command otherwise keeps up to 256 MiB of freed heap for the next step
    (:func:`hetero.placement.memory.retain_freed_memory`), so a step's transient needs larger than any
    before stayed resident: a step up with no leak (12.6 MiB on the dynamic parameter server, once, in
    a CI run). The ``MALLOC_*`` variables, set after, tell the command the thresholds are the user's
    choice. No-op where the C library is not glibc."""
    retain_freed_memory(DEFAULT_THRESHOLD, DEFAULT_THRESHOLD)
    os.environ.update(MALLOC_MMAP_THRESHOLD_=str(DEFAULT_THRESHOLD), MALLOC_TRIM_THRESHOLD_=str(DEFAULT_THRESHOLD))


def _rank(r, n, port, argv, out, sort_every_group=False):
    from hetero.cli import main
    from hetero.embedding import HostEmbeddingCollection, group

    _fixed_malloc_thresholds()
    if sort_every_group:  # (this process's: every group dedups by sorting, as those of 1 GiB or more do)
        group.SORTED_DEDUP_BYTES = 0
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n),
                      LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n))
    samples, times, trace, stop = [], [], [], threading.Event()

    sorting = []  # per step: every group of the model sorts (an empty marker)

    def on_step(trainer):
        samples.append(_rss_kib())
        times.append(time.time())
        if sort_every_group:
            groups = [g for m in trainer.model.modules() if isinstance(m, HostEmbeddingCollection) for g in m.groups]
            sorting.append(bool(groups) and all(g.deduper.marker.shape[0] == 0 for g in groups))

    def sample():  # (a parameter server has no steps of its own: its resident set by the clock)
        while not stop.wait(0.02):
            trace.append((time.time(), _rss_kib()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        code = main(argv, on_step=on_step)
    finally:
        stop.set()
        sampler.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Path(out, f"{r}.json").write_text(json.dumps({"code": code, "rss": samples, "times": times, "trace": trace,
                                                  "peak": peak, "sorting": sorting}))
    if code != 0:
        raise SystemExit(code)


def _low(trace, times, first, last):
    """The least resident set (KiB) a clock-sampled ``trace`` saw while the worker ran its steps
    ``first`` to ``last`` (1-based; from the end of the step before ``first`` to the end of ``last``).
    The least, not the last: a sample taken while the server was still inside a checkpoint (its copy
    of the shard, ~400 MiB here) can fall just before the worker's clock reads a step's end, as it did
    in CI; a leak raises the least too."""
    seen = [kib for t, kib in trace if times[first - 2] < t <= times[last - 1]]
    assert seen, f"no sample of the server's resident set during steps {first}-{last}"
    return min(seen)


DYNAMIC_MODES = {"dynamic_row_sharded": ["--table-sharding", "row"],
                 "dynamic_ssd": ["--table-storage", "ssd", "--cache-mb", "4"],
                 "dynamic_prefetch": ["--prefetch"],
                 "dynamic_ps": ["--ps-servers", "1", "--checkpoint-format", "sharded"]}
MODES = {
    "dp_replicated": [],
    "dp_row_sharded": ["--table-sharding", "row"],
    "tp": ["--tp", "2"],
    "zero": ["--zero", "2"],
    "pp": ["--pp", "2"],
    "ps": ["--ps-servers", "1", "--checkpoint-format", "sharded"],
    # each rank's tables (its replica, or its shard) on its SSD tier, checkpointed as the tier's snapshots
    "ssd": ["--table-storage", "ssd", "--cache-mb", "4"],
    "ssd_prefetch": ["--table-storage", "ssd", "--cache-mb", "4", "--prefetch"],
    "ssd_row_sharded": ["--table-storage", "ssd", "--cache-mb", "4", "--table-sharding", "row"],
    "ps_ssd": ["--ps-servers", "1", "--table-storage", "ssd", "--cache-mb", "4"],  # the server's shard on its tier
}
LONGER: dict[str, tuple[int, int]] = {}  # mode -> (steps, warm-up steps) where the defaults are too short


@pytest.mark.parametrize("mode", MODES)
def test_resident_memory_is_flat_per_step(tmp_path, mode):
    _check_flat(tmp_path, mode, 2)


@pytest.mark.parametrize("mode,ranks", [("dynamic", 1), ("dynamic", 2), ("dynamic_row_sharded", 2), ("dynamic_ssd", 1),
                                        ("dynamic_prefetch", 1), ("dynamic_ps", 2)],
                         ids=["one_process", "dp_replicated", "dp_row_sharded", "one_process_ssd", "one_process_prefetch",
                              "parameter_server"])
def test_resident_memory_is_flat_per_step_with_dynamic_tables(tmp_path, mode, ranks):
    """Dynamic tables admitting and evicting every step, in one process (in memory, on the SSD tier,
    and prefetched), replicated and row-sharded over 2 ranks, and on a parameter server (its key maps too)."""
    _check_flat(tmp_path, mode, ranks)


def test_resident_memory_is_flat_per_step_where_every_group_sorts(tmp_path):
    """The sort dedup's path (groups of ``SORTED_DEDUP_BYTES`` or more: its scratch arrays, reused
    by the group) in one process, with the threshold at 0 so this job's 109 MB of tables sort."""
    _check_flat(tmp_path, "dp_replicated", 1, sort_every_group=True)


def _check_flat(tmp_path, mode, ranks, sort_every_group=False):
    job, data = _job(tmp_path, dynamic=mode.startswith("dynamic"))
    steps, warm = LONGER.get(mode, (STEPS, WARM))
    argv = ["train", "--config", str(job), "--data-path", str(data), "--batch-size", "64", "--max-steps", str(steps),
            "--checkpoint-every", str(EVERY), "--no-progress", "--embedding-dim", "16", "--hidden", "64,32",
            "--run-dir", str(tmp_path / "run"), *MODES.get(mode, DYNAMIC_MODES.get(mode, []))]
    spawn(_rank, args=(ranks, free_port(), argv, str(tmp_path), sort_every_group), nprocs=ranks, env={**CPU_RANKS})
    table_mib = 26 * BUCKETS * 16 * 4 / 2**20
    for r in range(ranks):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        assert got["code"] == 0
        if sort_every_group:  # (else this test would measure the marker's path)
            assert got["sorting"] and all(got["sorting"]), got["sorting"]
        rss = [k / 1024 for k in got["rss"]]
        if not rss:  # a parameter server: no steps of its own - its resident set when the worker's steps ended
            assert "ps" in mode and r == 1
            worker = json.loads((tmp_path / "0.json").read_text())["times"]
            # the steps between checkpoints: after the warm-up's, and before the last
            assert warm % EVERY == 0 and steps % EVERY == 0
            warm_mib = _low(got["trace"], worker, warm + 1, warm + EVERY - 1) / 1024
            end_mib = _low(got["trace"], worker, steps - EVERY + 1, steps - 1) / 1024
            print(f"{mode} server rank {r}: warm {warm_mib:.0f} MiB, grew {end_mib - warm_mib:.1f} MiB, "
                  f"peak {got['peak'] / 1024:.0f} MiB")  # (pytest -s)
            # less than 2 MiB a step between the two windows' first steps
            assert end_mib - warm_mib < 2 * (steps - EVERY - warm), \
                f"{mode} server rank {r}: resident memory grew {end_mib - warm_mib:.0f} MiB after the workers' warm-up"
            continue
        assert len(rss) == steps
        grown = rss[-1] - rss[warm - 1]
        # flat after warm-up: 12 more steps and 2 more checkpoints add less than 2 MiB a step
        assert grown < 2 * (steps - warm), f"{mode} rank {r}: resident memory grew {grown:.0f} MiB after warm-up"
        # a checkpoint's peak stays within two more copies of the tables and their state (row-sharded
        # tables are gathered whole on every rank: the received blocks, then the whole tensors)
        over = got["peak"] / 1024 - rss[warm - 1]
        print(f"{mode} rank {r}: warm {rss[warm - 1]:.0f} MiB, grew {grown:.1f} MiB, peak +{over:.0f} MiB")  # (pytest -s)
        # (and a dynamic table's admission sketch, 1 MiB each here: a checkpoint holds it whole - row-sharded,
        # every rank's summed - as it holds the rows)
        sketches = 26 * 16 * BUCKETS / 2**20 if mode.startswith("dynamic") else 0
        assert over < 2 * 3 * table_mib + sketches, f"{mode} rank {r}: peak {over:.0f} MiB over the warm resident set"
