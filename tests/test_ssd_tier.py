"""The SSD tier (hetero.storage): host tables whose rows and optimizer state live in a file under a
small DRAM row cache train exactly as the same tables in memory (the independent reference), for
every sparse optimizer and table dtype, through checkpoints, and fail with one line naming the file."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from hetero.embedding import HostEmbeddingCollection, Pooling, TableConfig
from hetero.optim import SparseOptimizerKind
from hetero.placement import StorageTier
from hetero.storage.cache import CachePolicy, RowCache
from hetero.storage.records import RowFile
from hetero.storage.config import SsdConfig

from conftest import movielens

ROWS_A, ROWS_B, DIM = 3000, 2000, 16
CACHE_ROWS = 300  # a batch touches ~250 rows: every step evicts


def _tables(ssd: SsdConfig | None, dtype=torch.float32, pooling=Pooling.SUM):
    torch.manual_seed(0)
    kw = dict(storage=StorageTier.SSD, ssd=ssd) if ssd else {}
    return HostEmbeddingCollection([TableConfig("a", ROWS_A, DIM, pooling=pooling, dtype=dtype, **kw),
                                    TableConfig("b", ROWS_B, DIM, dtype=dtype, **kw)])


def _batches(steps=50, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):  # skewed ids (squares): some rows come back often, most rarely
        yield {"a": torch.randint(0, ROWS_A, (64, 3), generator=g) ** 2 % ROWS_A,
               "b": torch.randint(0, ROWS_B, (64,), generator=g)}


def _train(model, opt, batches):
    losses = []
    for feats in batches:
        opt.zero_grad()
        out = model(feats)
        a = out["a"].float().sum(1) if out["a"].dim() == 3 else out["a"].float()  # (per-id rows, or bags)
        loss = (a.sum(1) * out["b"].float().sum(1)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _record_bytes(kind, dtype=torch.float32):
    state = {SparseOptimizerKind.LAZY_ADAM: 2 * DIM, SparseOptimizerKind.FTRL: 2 * DIM,
             SparseOptimizerKind.ADAGRAD: DIM, SparseOptimizerKind.ROWWISE_ADAGRAD: 1, SparseOptimizerKind.SGD: 0}[kind]
    return DIM * torch.empty((), dtype=dtype).element_size() + 4 * state


def _assert_same(mem, ssd, mem_opt, ssd_opt):
    a, b = mem.state_dict(), ssd.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = mem_opt.state_dict()["state"], ssd_opt.state_dict()["state"]
    for t in sa:
        for s in sa[t]:
            assert torch.equal(sa[t][s], sb[t][s]), (t, s)


def load_whole(path):
    """A ``hetero train`` checkpoint with the tables on the SSD tier read back into it from the tier's
    snapshots (hetero.storage.snapshot.read_fields), as a checkpoint of the tables in memory holds them."""
    from hetero.storage import snapshot

    state = torch.load(path, map_location="cpu", weights_only=False)
    entry = state.pop("tier", None)
    for key, saved in (entry["groups"] if entry else {}).items():
        parts = [snapshot.read_fields(path.parent / entry["directory"] / f"rank{r}" / saved["name"])
                 for r in range(saved["parts"])]
        fields = {f: torch.cat([p[f] for p in parts]) for f in parts[0]}
        start = 0
        for name, rows in saved["tables"]:
            state["model"][f"{name}.weight"] = fields["weight"][start : start + rows]
            opt = next(o for o in state["sparse_optimizers"].values() if name in o["steps"])
            opt["state"][name] = {f: v[start : start + rows] for f, v in fields.items() if f != "weight"}
            start += rows
    return state


@pytest.mark.parametrize("kind", list(SparseOptimizerKind))
def test_training_on_the_ssd_tier_equals_training_in_memory(tmp_path, kind):
    ssd_cfg = SsdConfig(tmp_path, cache_bytes=CACHE_ROWS * _record_bytes(kind))
    mem, ssd = _tables(None), _tables(ssd_cfg)
    mem_opt, ssd_opt = kind.optimizer(mem.tables.values()), kind.optimizer(ssd.tables.values())
    assert _train(ssd, ssd_opt, _batches()) == _train(mem, mem_opt, _batches())
    tier = ssd.groups[0].ssd
    assert tier.cache.capacity == CACHE_ROWS and tier.cache.stats.write_backs > 1000  # the tier was exercised:
    assert tier.file.cleaned > 0  # write-backs appended, segments cleaned, and the file stays within its bound
    assert tier.file.nbytes <= (RowFile.GC_RATIO * tier.file.rows + tier.file.segment) * tier.file.slot_bytes
    _assert_same(mem, ssd, mem_opt, ssd_opt)


@pytest.mark.parametrize("kind", [SparseOptimizerKind.LAZY_ADAM, SparseOptimizerKind.ROWWISE_ADAGRAD])
def test_tables_of_per_id_lookups_train_exactly(tmp_path, kind):
    # no bags: in memory the update follows each row's occurrence chain, here the gradient is coalesced first
    ssd_cfg = SsdConfig(tmp_path, cache_bytes=CACHE_ROWS * _record_bytes(kind))
    mem, ssd = _tables(None, pooling=Pooling.NONE), _tables(ssd_cfg, pooling=Pooling.NONE)
    mem_opt, ssd_opt = kind.optimizer(mem.tables.values()), kind.optimizer(ssd.tables.values())
    assert _train(ssd, ssd_opt, _batches(30)) == _train(mem, mem_opt, _batches(30))
    _assert_same(mem, ssd, mem_opt, ssd_opt)


@pytest.mark.parametrize("policy", list(CachePolicy))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_either_policy_and_low_precision_rows_train_exactly(tmp_path, policy, dtype):
    kind = SparseOptimizerKind.LAZY_ADAM
    ssd_cfg = SsdConfig(tmp_path, cache_bytes=CACHE_ROWS * _record_bytes(kind, dtype), policy=policy)
    mem, ssd = _tables(None, dtype), _tables(ssd_cfg, dtype)
    mem_opt, ssd_opt = kind.optimizer(mem.tables.values()), kind.optimizer(ssd.tables.values())
    assert _train(ssd, ssd_opt, _batches(30)) == _train(mem, mem_opt, _batches(30))
    _assert_same(mem, ssd, mem_opt, ssd_opt)


def test_a_checkpoint_of_ssd_tables_resumes_exactly(tmp_path):
    kind = SparseOptimizerKind.FTRL
    ssd_cfg = SsdConfig(tmp_path / "run1", cache_bytes=CACHE_ROWS * _record_bytes(kind))
    mem, ssd = _tables(None), _tables(ssd_cfg)
    mem_opt, ssd_opt = kind.optimizer(mem.tables.values()), kind.optimizer(ssd.tables.values())
    batches = list(_batches(40))
    _train(mem, mem_opt, batches)
    _train(ssd, ssd_opt, batches[:20])
    saved = {"model": ssd.state_dict(), "opt": ssd_opt.state_dict()}
    torch.save(saved, tmp_path / "ckpt.pt")
    # a new process's tables (a new scratch directory), loaded from the checkpoint, then the last 20 steps
    resumed = _tables(SsdConfig(tmp_path / "run2", cache_bytes=CACHE_ROWS * _record_bytes(kind)))
    resumed_opt = kind.optimizer(resumed.tables.values())
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    resumed.load_state_dict(loaded["model"])
    resumed_opt.load_state_dict(loaded["opt"])
    _train(resumed, resumed_opt, batches[20:])
    _assert_same(mem, resumed, mem_opt, resumed_opt)


def test_a_batch_larger_than_the_cache_is_refused_naming_the_size(tmp_path):
    kind = SparseOptimizerKind.SGD
    ssd = _tables(SsdConfig(tmp_path, cache_bytes=10 * _record_bytes(kind)))
    opt = kind.optimizer(ssd.tables.values())
    with pytest.raises(ValueError, match=r"a batch touches \d+ rows of a-b.rows but its cache holds 10: give the cache "
                                         r"at least \d+ rows"):
        _train(ssd, opt, _batches(1))


def test_a_table_on_the_ssd_tier_needs_its_settings():
    with pytest.raises(ValueError, match="takes an SsdConfig"):
        TableConfig("t", 10, 4, storage=StorageTier.SSD)


def test_a_write_the_disk_refuses_is_one_line_naming_the_file(tmp_path):
    # RLIMIT_FSIZE: the file cannot grow past 64 KiB (Python ignores SIGXFSZ: the write fails with EFBIG)
    # (the kernels are compiled first, on a small table: numba's cache files, written when a kernel is
    # compiled, would hit the limit themselves)
    script = f"""
import resource, torch
from hetero.embedding import HostEmbeddingCollection, TableConfig
from hetero.optim import SparseOptimizerKind
from hetero.placement import StorageTier
from hetero.storage.config import SsdConfig
w = HostEmbeddingCollection([TableConfig("warm", 100, 16, storage=StorageTier.SSD, ssd=SsdConfig({str(tmp_path / "warm")!r}))])
SparseOptimizerKind.SGD.optimizer(w.tables.values())
w({{"warm": torch.arange(10)}})
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
t = HostEmbeddingCollection([TableConfig("big", 100000, 16, storage=StorageTier.SSD, ssd=SsdConfig({str(tmp_path)!r}))])
SparseOptimizerKind.SGD.optimizer(t.tables.values())  # (declares the records' layout: nothing written yet)
try:
    t({{"big": torch.arange(10)}})  # the first lookup lays the rows out
except OSError as e:
    print("ERROR", e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("ERROR") and str(tmp_path / "big.rows") in line and "File too large" in line, out.stdout + out.stderr


def test_the_row_cache_writes_back_what_it_gives_up(tmp_path, monkeypatch):
    # the break check, kept: a cache that drops its write-backs trains differently from memory
    kind = SparseOptimizerKind.SGD
    monkeypatch.setattr(RowCache, "_write", lambda self, rows, slots: None)
    mem, ssd = _tables(None), _tables(SsdConfig(tmp_path, cache_bytes=CACHE_ROWS * _record_bytes(kind)))
    mem_opt, ssd_opt = kind.optimizer(mem.tables.values()), kind.optimizer(ssd.tables.values())
    assert _train(ssd, ssd_opt, _batches(20)) != _train(mem, mem_opt, _batches(20))


@pytest.mark.parametrize("kind", [SparseOptimizerKind.LAZY_ADAM, SparseOptimizerKind.ROWWISE_ADAGRAD,
                                  SparseOptimizerKind.FTRL])
@pytest.mark.parametrize("worker", [False, True])
def test_prefetched_reads_ahead_are_never_stale(tmp_path, kind, worker):
    # depth 2: batch i+2's records are read while batch i trains, and batch i+1's lookup may write back
    # rows batch i updated - a read-ahead record of such a row is stale and must be read again (worker
    # False: deterministic, the read-ahead happens before batch i trains)
    from hetero.embedding import PrefetchConfig, Prefetcher

    ssd_cfg = SsdConfig(tmp_path, cache_bytes=CACHE_ROWS * _record_bytes(kind))
    mem, ssd = _tables(None), _tables(ssd_cfg)
    mem_opt, ssd_opt = kind.optimizer(mem.tables.values()), kind.optimizer(ssd.tables.values())
    ahead = Prefetcher(ssd, _batches(), PrefetchConfig(depth=2, worker=worker), features=lambda b: b)
    assert _train(ssd, ssd_opt, ahead) == _train(mem, mem_opt, _batches())
    stats = ssd.groups[0].ssd.cache.stats
    assert stats.staged > stats.misses / 2 and stats.write_backs > 1000  # most misses were read ahead
    _assert_same(mem, ssd, mem_opt, ssd_opt)


def test_a_read_ahead_record_whose_slot_was_reused_is_read_again(tmp_path):
    # the row leaves its slot and comes back to the same slot after the cleaner freed and reused the
    # segment: the slot alone cannot tell, the segment's generation does
    import numpy as np

    from hetero.storage.layout import Field, RecordLayout

    file = RowFile(tmp_path / "f.rows", RecordLayout((Field("w", torch.float32, 4),)), rows=64, threads=2)
    row = np.array([5], np.int64)
    file.write(row, np.zeros((1, 16), np.uint8))  # (into a segment of its own: the first is full)
    file.writer.drain()  # (a record not written yet is not read ahead)
    staged = file.stage(row)
    for i in range(1, 500):
        file.write(row, np.full((1, 4), i, np.float32).view(np.uint8))
        if file.positions[5] == staged.slots[0]:
            break
    assert file.positions[5] == staged.slots[0] and file.generation[staged.slots[0] // file.segment] > 0
    got = np.zeros((1, 16), np.uint8)
    assert file.load(row, np.array([0]), (got,), np.array([0]), staged) == 0  # refused: read again
    assert got.view(np.float32)[0, 0] == i
    file.close()


def test_a_flush_of_more_rows_than_a_piece_writes_every_one_back(tmp_path):
    # the write-back of a whole cache goes in pieces (FLUSH_CHUNK): every row lands, none twice
    import numpy as np

    from hetero.storage.cache import FLUSH_CHUNK
    from hetero.storage.layout import Field, RecordLayout

    rows = FLUSH_CHUNK * 2 + 123
    file = RowFile(tmp_path / "f.rows", RecordLayout((Field("w", torch.float32, 2),)), rows=rows, threads=2)
    cache = RowCache(file, rows)
    slots = cache.acquire(np.arange(rows, dtype=np.int64))
    cache.fields["w"][torch.from_numpy(slots)] = torch.arange(2 * rows, dtype=torch.float32).view(rows, 2)
    cache.mark_dirty(slots)
    cache.flush()
    assert not cache.dirty.any() and file.live.sum() == rows
    got = np.empty((rows, 8), np.uint8)
    file.read(np.arange(rows, dtype=np.int64), got)
    assert np.array_equal(got.view(np.float32).reshape(rows, 2), np.arange(2 * rows, dtype=np.float32).reshape(rows, 2))
    file.close()


def test_the_main_job_on_the_ssd_tier_equals_it_in_memory(tmp_path, ml_dir):
    from hetero.cli import main

    args = [*movielens(ml_dir), "--epochs", "2"]
    assert main(["train", *args, "--run-dir", str(tmp_path / "mem")]) == 0
    # (no segment mapped: every read a pread - the mapped reads are the other tests')
    assert main(["train", *args, "--run-dir", str(tmp_path / "ssd"), "--table-storage", "ssd", "--cache-mb", "1",
                 "--mapped-mb", "0.001"]) == 0
    assert (tmp_path / "ssd" / "ssd").is_dir()  # the default place of the row files: RUN_DIR/ssd
    mem, ssd = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("mem", "ssd"))
    assert (mem["test_auc"], mem["test_logloss"]) == (ssd["test_auc"], ssd["test_logloss"])
    a, b = (load_whole(tmp_path / d / "checkpoint.pt") for d in ("mem", "ssd"))
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert 'storage = "ssd"' in (tmp_path / "ssd" / "config.toml").read_text()
    assert "mapped_mb = 0.001" in (tmp_path / "ssd" / "config.toml").read_text()


def test_evaluation_and_predict_fit_a_cache_smaller_than_their_batches(tmp_path, ml_dir, capsys):
    """A cache that holds every training batch's rows but not an evaluation batch's (8192 samples):
    evaluation and predict read in pieces (no update follows), and the run equals it in memory."""
    from hetero.cli import main

    args = [*movielens(ml_dir), "--epochs", "1", "--batch-size", "16", "--patience", "0"]
    assert main(["train", *args, "--run-dir", str(tmp_path / "mem")]) == 0
    assert main(["train", *args, "--run-dir", str(tmp_path / "ssd"), "--table-storage", "ssd", "--cache-mb",
                 "0.02"]) == 0  # (109 rows: a training batch touches at most 16 of each of its 8 tables)
    mem, ssd = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("mem", "ssd"))
    assert (mem["test_auc"], mem["test_logloss"]) == (ssd["test_auc"], ssd["test_logloss"])
    capsys.readouterr()
    data = ml_dir / "ml-100k.inter"
    for d in ("mem", "ssd"):
        assert main(["predict", "--checkpoint", str(tmp_path / d / "checkpoint.pt"), "--data", str(data), "--out",
                     str(tmp_path / f"{d}.csv"), "--cache-mb", "0.02"]) == 0
    assert (tmp_path / "mem.csv").read_text() == (tmp_path / "ssd.csv").read_text()


def test_the_ssd_tier_is_refused_beside_what_it_does_not_run_with(ml_dir, capsys):
    from hetero.cli import main

    assert main(["train", *movielens(ml_dir), "--table-storage", "ssd", "--pp", "2"]) == 1
    assert "tables.storage (--table-storage ssd) with parallelism.pp (--pp)" in capsys.readouterr().err


def test_the_criteo_job_on_the_ssd_tier_trains_and_predicts(tmp_path, capsys):
    import pyarrow.parquet as pq
    from sklearn.metrics import roc_auc_score

    from conftest import EXAMPLES, criteo_lines
    from hetero.cli import main

    plain, ssd = (EXAMPLES / "criteo.toml").read_text(), (EXAMPLES / "criteo_ssd.toml").read_text()
    marked = [line for line in ssd.splitlines() if "SSD tier" in line and not line.startswith("#")]
    assert [line for line in ssd.splitlines() if line not in marked and not line.startswith("#")] == \
        [line for line in plain.splitlines() if not line.startswith("#")]  # the SSD lines, and nothing else
    job = tmp_path / "criteo_ssd.toml"
    job.write_text(ssd.replace("hash_buckets = 262144", "hash_buckets = 64"))
    data = tmp_path / "criteo.tsv"
    data.write_text(criteo_lines(600))
    common = ["--data-path", str(data), "--batch-size", "64", "--no-progress"]
    assert main(["train", "--config", str(job), *common, "--cache-mb", "1", "--run-dir", str(tmp_path / "run")]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["train", "--config", str(job), *common, "--table-storage", "memory", "--run-dir",
                 str(tmp_path / "mem")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["test_auc"] == metrics["test_auc"]
    out = tmp_path / "scores.parquet"
    assert main(["predict", "--checkpoint", str(tmp_path / "run" / "checkpoint.pt"), "--config", str(job), "--data",
                 str(data), "--out", str(out)]) == 0
    scores = pq.read_table(out)
    assert scores.num_rows == 600 and 0 <= roc_auc_score(scores.column("label").to_numpy(),
                                                         scores.column("score").to_numpy()) <= 1


def test_replicated_ssd_tables_at_2_ranks_train_as_in_memory(tmp_path, ml_dir):
    from conftest import hetero_on_ranks

    args = ["train", *movielens(ml_dir), "--epochs", "1", "--no-progress"]
    mem = hetero_on_ranks(tmp_path, 2, [*args, "--run-dir", str(tmp_path / "mem")])
    assert mem.returncode == 0, mem.stderr[-2000:]
    ssd = hetero_on_ranks(tmp_path, 2, [*args, "--run-dir", str(tmp_path / "ssd"), "--table-storage", "ssd",
                                        "--cache-mb", "1"])
    assert ssd.returncode == 0, ssd.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "ssd" / "ssd").iterdir()) == ["rank0", "rank1"]  # a replica each
    a, b = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("mem", "ssd"))
    assert (a["test_auc"], a["test_logloss"], a["world_size"]) == (b["test_auc"], b["test_logloss"], 2)
    ca, cb = (load_whole(tmp_path / d / "checkpoint.pt") for d in ("mem", "ssd"))
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k


def test_row_sharded_ssd_tables_at_2_ranks_stopped_and_resumed_train_as_in_memory(tmp_path, cpu_ranks):
    # 26 tables of 4096 rows in one group, each rank's shard of 53k rows on its own tier under a cache of
    # 0.4 MiB (~2k rows, a step's rows at most: every step evicts); the in-memory run uninterrupted is the
    # reference, and the in-memory run stopped and resumed too (a group of several tables, cut in one)
    from conftest import criteo_job, criteo_lines, hetero_on_ranks

    data = tmp_path / "c.tsv"
    data.write_text(criteo_lines(600, categories=3000))
    args = ["train", "--config", str(criteo_job(tmp_path, 4096)), "--data-path", str(data), "--batch-size", "64",
            "--no-progress", "--table-sharding", "row"]

    def run(name, *extra, stop=False):
        common = [*args, "--run-dir", str(tmp_path / name), *extra]
        if stop:
            done = hetero_on_ranks(tmp_path, 2, [*common, "--max-steps", "3"])
            assert done.returncode == 0, done.stderr[-2000:]
            shutil.copytree(tmp_path / name, tmp_path / f"{name}_half")  # (for the resume in one process, below)
            common.append("--resume")
        done = hetero_on_ranks(tmp_path, 2, common)
        assert done.returncode == 0, done.stderr[-2000:]
        return load_whole(tmp_path / name / "checkpoint.pt")

    ssd_args = ("--table-storage", "ssd", "--cache-mb", "0.4")
    reference, resumed, ssd = run("mem"), run("mem_resumed", stop=True), run("ssd", *ssd_args, stop=True)
    assert sorted(p.name for p in (tmp_path / "ssd" / "ssd").iterdir()) == ["rank0", "rank1"]  # a shard each
    for label, other in (("resumed", resumed), ("ssd", ssd)):
        assert other["position"] == reference["position"]
        for k in reference["model"]:
            assert torch.equal(reference["model"][k], other["model"][k]), (label, k, (reference["model"][k] - other["model"][k]).abs().max())
        for opt, saved in reference["sparse_optimizers"].items():
            for table, tensors in saved["state"].items():
                for s, v in tensors.items():
                    assert torch.equal(other["sparse_optimizers"][opt]["state"][table][s], v), (opt, table, s)
    # another world size: the 2-rank checkpoints resumed in one process (the tier's two shards read into
    # one store), against the tables in memory resumed so
    from hetero.cli import main

    ends = []
    for name, extra, half in (("mem_one", (), "mem_resumed_half"), ("ssd_one", ssd_args, "ssd_half")):
        shutil.copytree(tmp_path / half, tmp_path / name)  # (the 2-rank first half above: copied, not rerun)
        assert main([*args, "--run-dir", str(tmp_path / name), *extra, "--resume"]) == 0
        ends.append(load_whole(tmp_path / name / "checkpoint.pt"))
    assert ends[0]["position"] == ends[1]["position"] == reference["position"]
    for k in ends[0]["model"]:
        assert torch.equal(ends[0]["model"][k], ends[1]["model"][k]), k


def test_explain_shows_the_tier_its_cache_and_hit_rate(tmp_path):
    import hetero

    kind = SparseOptimizerKind.ADAGRAD
    ssd = _tables(SsdConfig(tmp_path, cache_bytes=CACHE_ROWS * _record_bytes(kind)))
    opt = kind.optimizer(ssd.tables.values())
    _train(ssd, opt, _batches(5))
    stats = ssd.groups[0].ssd.cache.stats
    text = str(hetero.explain(ssd, (next(_batches(1)),)))
    assert f"SSD tier:\n  tables.a, tables.b: {ROWS_A + ROWS_B} rows in {tmp_path}; cache " in text
    assert f"({CACHE_ROWS} rows of {_record_bytes(kind)} bytes, lfu)" in text
    assert f"hit rate {stats.hit_rate:.1%} of {stats.hits + stats.misses} rows looked up so far" in text


def test_a_run_on_the_ssd_tier_stopped_and_resumed_equals_one_run(tmp_path, ml_dir):
    from hetero.cli import main

    args = [*movielens(ml_dir), "--epochs", "2", "--no-progress", "--table-storage", "ssd", "--cache-mb", "1"]
    assert main(["train", *args, "--run-dir", str(tmp_path / "whole")]) == 0
    assert main(["train", *args, "--run-dir", str(tmp_path / "part"), "--max-steps", "5"]) == 0
    assert main(["train", *args, "--run-dir", str(tmp_path / "part"), "--resume"]) == 0  # a new scratch file, loaded
    a, b = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("whole", "part"))
    assert (a["test_auc"], a["test_logloss"], a["steps"]) == (b["test_auc"], b["test_logloss"], b["steps"])
    ca, cb = (load_whole(tmp_path / d / "checkpoint.pt") for d in ("whole", "part"))
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
