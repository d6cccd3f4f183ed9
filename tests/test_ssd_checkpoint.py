"""Checkpoints of tables on the SSD tier that never hold the tables in memory (hetero.storage.snapshot):
links to the tier's sealed segment files plus its row index, incremental, checksummed, restored
exactly - against the same tables trained in memory without a break (the independent reference)."""

import os

import numpy as np
import pytest
import torch

from hetero.checkpoint import CheckpointError
from hetero.optim import SparseOptimizerKind
from hetero.storage import snapshot
from hetero.storage.config import SsdConfig

from test_ssd_tier import CACHE_ROWS, _assert_same, _batches, _record_bytes, _tables, _train

KIND = SparseOptimizerKind.LAZY_ADAM


def _ssd(tmp_path, name):
    tables = _tables(SsdConfig(tmp_path / name, cache_bytes=CACHE_ROWS * _record_bytes(KIND)))
    return tables, KIND.optimizer(tables.tables.values())


def _group(tables):
    (group,) = tables.groups
    return group


def test_a_snapshot_restored_into_new_tables_continues_exactly_and_the_next_is_incremental(tmp_path):
    mem = _tables(None)
    mem_opt = KIND.optimizer(mem.tables.values())
    _train(mem, mem_opt, _batches(50))
    ssd, opt = _ssd(tmp_path, "run")
    batches = list(_batches(50))
    _train(ssd, opt, batches[:20])
    first = _group(ssd).ssd_checkpoint(tmp_path / "ckpt1")
    counts = opt.state_dict(include_state=False)
    _train(ssd, opt, batches[20:21])  # one more step: few segments change
    second = _group(ssd).ssd_checkpoint(tmp_path / "ckpt2")
    shared = [n for n in second["segments"] if n in first["segments"]
              and os.stat(tmp_path / "ckpt1" / n).st_ino == os.stat(tmp_path / "ckpt2" / n).st_ino]
    # (new: the segments of one step's write-backs and of the cleaner's moves, each stream its own)
    assert shared and len(shared) >= len(second["segments"]) - 4, (len(shared), len(second["segments"]))
    _train(ssd, opt, batches[21:])  # the original run goes on: the snapshots' files must not change
    resumed, resumed_opt = _ssd(tmp_path, "resumed")
    _group(resumed).ssd_restore([(tmp_path / "ckpt1", snapshot.verify(tmp_path / "ckpt1"))])
    resumed_opt.load_state_dict(counts)
    _train(resumed, resumed_opt, batches[20:])
    _assert_same(mem, resumed, mem_opt, resumed_opt)
    _assert_same(mem, ssd, mem_opt, opt)


def test_a_flipped_byte_in_a_segment_or_the_index_is_named_on_load(tmp_path):
    ssd, opt = _ssd(tmp_path, "run")
    _train(ssd, opt, _batches(10))
    manifest = _group(ssd).ssd_checkpoint(tmp_path / "ckpt")
    for name in (sorted(manifest["segments"])[0], "index.bin"):
        path = tmp_path / "ckpt" / name
        data = bytearray(path.read_bytes())
        os.unlink(path)  # (the segment is a link to the tier's file: write a new one)
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=rf"{path} does not match its checksum .* the file is damaged"):
            snapshot.verify(tmp_path / "ckpt")
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    snapshot.verify(tmp_path / "ckpt")
    os.unlink(tmp_path / "ckpt" / "manifest.json")  # a snapshot the writer did not finish
    with pytest.raises(CheckpointError, match="manifest.json is missing: the SSD tier's checkpoint .* is unfinished"):
        snapshot.verify(tmp_path / "ckpt")


def test_a_snapshots_checksums_are_zlibs_crc32_of_its_files(tmp_path):
    # the writer keeps each segment's CRC-32 as it appends (computed by zlib-ng): the checkpoint format's
    # checksum is zlib's CRC-32, checked here against the standard library's over the files' bytes
    import json
    import zlib

    ssd, opt = _ssd(tmp_path, "run")
    _train(ssd, opt, _batches(10))
    manifest = _group(ssd).ssd_checkpoint(tmp_path / "ckpt")
    assert manifest["segments"]
    for name, (size, crc) in manifest["segments"].items():
        data = (tmp_path / "ckpt" / name).read_bytes()
        assert (len(data), zlib.crc32(data)) == (size, crc), name
    on_disk = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    index, size, crc = on_disk["index"]
    assert zlib.crc32((tmp_path / "ckpt" / index).read_bytes()) == crc


def test_snapshots_of_two_shards_restore_into_one_store_and_back(tmp_path):
    # another world size: one store's rows cut into the two halves of two ranks, and those two
    # snapshots read back into one store
    ssd, opt = _ssd(tmp_path, "run")
    _train(ssd, opt, _batches(10))
    whole = _group(ssd).ssd_read(0, 5000)
    full = [(tmp_path / "full", _group(ssd).ssd_checkpoint(tmp_path / "full"))]

    def shard(name, first_row):  # a fresh group holding global rows [first_row, first_row + 2500), as row sharding sets it
        g = _group(_ssd(tmp_path, name)[0])
        g.first_row, g.storage = first_row, g.storage[:2500]
        return g

    halves = []
    for name, first_row in (("hi", 2500), ("lo", 0)):
        g = shard(name, first_row)
        g.ssd_restore(full)
        got = g.ssd_read(0, 2500)
        for k in whole:
            assert torch.equal(got[k], whole[k][first_row : first_row + 2500]), (name, k)
        halves.append((tmp_path / f"snap_{name}", g.ssd_checkpoint(tmp_path / f"snap_{name}")))
    back = _group(_ssd(tmp_path, "back")[0])
    back.ssd_restore(halves)
    again = back.ssd_read(0, 5000)
    for k in whole:
        assert torch.equal(again[k], whole[k]), k
    with pytest.raises(CheckpointError, match=r"do not hold rows \[0, 5000\)"):
        _group(_ssd(tmp_path, "short")[0]).ssd_restore(halves[:1])


def test_a_write_failure_while_checkpointing_is_one_line_and_the_last_checkpoint_loads(tmp_path):
    import subprocess
    import sys

    # RLIMIT_FSIZE below the row index's size (8 bytes a row) and above a segment file's
    script = f"""
import resource, sys
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from test_ssd_checkpoint import _ssd, _group
from test_ssd_tier import _batches, _train
from pathlib import Path
tmp = Path({str(tmp_path)!r})
ssd, opt = _ssd(tmp, "run")
_train(ssd, opt, _batches(5))
_group(ssd).ssd_checkpoint(tmp / "ok")
resource.setrlimit(resource.RLIMIT_FSIZE, (35000, 35000))
_train(ssd, opt, _batches(5))
try:
    _group(ssd).ssd_checkpoint(tmp / "failed")
except OSError as e:
    print("ERROR", e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    line = (out.stdout.strip().splitlines() or [out.stderr])[-1]
    assert line.startswith("ERROR") and str(tmp_path / "failed") in line and "File too large" in line and \
        "the last checkpoint is intact" in line, out.stdout + out.stderr
    assert not (tmp_path / "failed" / "manifest.json").exists()
    snapshot.verify(tmp_path / "ok")
    np.testing.assert_array_equal(np.fromfile(tmp_path / "ok" / "index.bin", np.int64).shape, (5000,))


_KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from hetero.cli import main
from hetero.storage import cache, snapshot

where, at = sys.argv[1], int(sys.argv[2])
calls = [0]
if where == "checkpoint":  # in the at-th snapshot, after its segments and index, before its manifest
    write = snapshot.write

    def killed(file, dest, extra=None):
        calls[0] += 1
        if calls[0] == at:
            os.replace = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        return write(file, dest, extra)

    snapshot.write = killed
else:  # in the middle of a step: the at-th lookup of the row cache, after write-backs of the step before
    acquire = cache.RowCache.acquire

    def killed(self, *a, **k):
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return acquire(self, *a, **k)

    cache.RowCache.acquire = killed
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("where", ["checkpoint", "step"])
def test_kill_9_leaves_the_last_checkpoint_loadable_and_the_resume_exact(tmp_path, ml_dir, where):
    import subprocess
    import sys

    from conftest import movielens
    from hetero.cli import main
    from test_ssd_tier import load_whole

    args = ["train", *movielens(ml_dir), "--epochs", "2", "--no-progress", "--table-storage", "ssd", "--cache-mb",
            "0.2", "--checkpoint-every", "3"]
    assert main([*args, "--run-dir", str(tmp_path / "one")]) == 0
    script = _KILLED.format(tests=os.path.dirname(__file__))
    run = [sys.executable, "-c", script, where, "3" if where == "checkpoint" else "23", *args, "--run-dir",
           str(tmp_path / "killed")]
    done = subprocess.run(run, capture_output=True, text=True, timeout=600)
    assert done.returncode == -9, done.stderr[-2000:]
    assert main([*args, "--run-dir", str(tmp_path / "killed"), "--resume"]) == 0
    a, b = load_whole(tmp_path / "one" / "checkpoint.pt"), load_whole(tmp_path / "killed" / "checkpoint.pt")
    assert a["position"] == b["position"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for opt, saved in a["sparse_optimizers"].items():
        for table, tensors in saved["state"].items():
            for s, v in tensors.items():
                assert torch.equal(b["sparse_optimizers"][opt]["state"][table][s], v), (opt, table, s)
    # the unfinished and earlier saves are gone (best.pt's snapshots apart: a default run keeps the best epoch)
    assert len(list((tmp_path / "killed" / "tier").glob("checkpoint-step*"))) == 1


def test_hetero_train_names_a_damaged_tier_file_on_resume_and_changes_nothing(tmp_path, ml_dir, capsys):
    from conftest import movielens
    from hetero.cli import main

    args = ["train", *movielens(ml_dir), "--epochs", "1", "--no-progress", "--table-storage", "ssd", "--run-dir",
            str(tmp_path / "run")]
    assert main(args) == 0
    (directory,) = (tmp_path / "run" / "tier").glob("checkpoint-step*")
    segment = sorted(directory.rglob("*.seg"))[0]
    data = bytearray(segment.read_bytes())
    data[-5] ^= 1
    segment.write_bytes(bytes(data))
    before = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    assert main([*args, "--resume"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{segment} does not match its checksum" in err[0] and "the file is damaged" in err[0]
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == before
