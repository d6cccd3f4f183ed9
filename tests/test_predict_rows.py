"""``hetero predict`` at the edges: one output row per input row in input order (a bad row keeps its
place with a null score), ids exactly as the file has them, output created before scoring and
streamed in pieces (resident memory flat in the row count), scratch space only where it is needed."""

import json
import os
from pathlib import Path

import numpy as np
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from hetero.cli import main
from test_run_record import TRAIN, _job, _rows, _write

BIG = 10000174058809263569  # an Avazu id: above 2**63, a double in pyarrow's inference (none survive)


def _trained(tmp_path, skip=True):
    data = tmp_path / "data.csv"
    rows = _rows(400)
    _write(data, rows)
    job = _job(tmp_path, data)
    if skip:
        job.write_text(job.read_text().replace("[data]\n", '[data]\non_bad_rows = "skip"\n'))
    assert main(["train", "--config", str(job), *TRAIN, "--run-dir", str(tmp_path / "run")]) == 0
    return tmp_path / "run" / "checkpoint.pt", rows


def _score_file(path, rows, bad=()):
    """``rows`` with 64-bit ids; the rows at ``bad`` with an age that is not a number."""
    lines = [f"{BIG + i},{y},{c},{'x' if i in bad else a},{n}" for i, (_, y, c, a, n) in enumerate(rows)]
    path.write_text("key,y,city,age,note\n" + "\n".join(lines) + "\n")


def test_predict_keeps_every_row_in_place_with_a_null_score_for_a_bad_one_and_ids_exact(tmp_path, capsys):
    checkpoint, rows = _trained(tmp_path)
    bad = {3, 4, 150, 399}
    _score_file(tmp_path / "bad.csv", rows, bad)
    _score_file(tmp_path / "clean.csv", rows)  # the reference: the same rows, none bad
    for name in ("bad", "clean"):
        capsys.readouterr()
        assert main(["predict", "--checkpoint", str(checkpoint), "--data", str(tmp_path / f"{name}.csv"),
                     "--out", str(tmp_path / f"{name}.parquet"), "--id-column", "key"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    got, want = (pq.read_table(tmp_path / f"{n}.parquet") for n in ("bad", "clean"))
    assert got.num_rows == len(rows) == want.num_rows
    assert got.column("key").to_pylist() == [str(BIG + i) for i in range(len(rows))]  # exact, in input order
    score, ref = got.column("score").to_pylist(), want.column("score").to_pylist()
    assert [i for i, s in enumerate(score) if s is None] == sorted(bad)
    keep = [i for i in range(len(rows)) if i not in bad]  # every other row its own score (to float rounding: a
    assert np.allclose([score[i] for i in keep], [ref[i] for i in keep], rtol=0, atol=1e-6)  # batch of other rows)
    assert np.std([ref[i] for i in keep]) > 0.01  # (a shifted row would not match)
    assert got.column("label").null_count == len(bad)
    assert printed["bad_rows"] == 0 and printed["rows"] == len(rows)
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(checkpoint), "--data", str(tmp_path / "bad.csv"),
                 "--out", str(tmp_path / "bad.csv.scores.csv")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bad_rows"] == len(bad)
    assert pacsv.read_csv(tmp_path / "bad.csv.scores.csv").column("score").null_count == len(bad)


def test_predict_refuses_a_row_it_cannot_place_naming_it_and_writes_nothing(tmp_path, capsys):
    checkpoint, rows = _trained(tmp_path)
    _score_file(tmp_path / "torn.csv", rows)
    text = (tmp_path / "torn.csv").read_text().splitlines()
    text[7] = "1,a"  # two fields of five
    (tmp_path / "torn.csv").write_text("\n".join(text) + "\n")
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(checkpoint), "--data", str(tmp_path / "torn.csv"),
                 "--out", str(tmp_path / "s.csv")]) == 1
    err = capsys.readouterr().err.strip()
    assert "Expected 5 columns, got 2: 1,a; hetero predict writes one score per input row" in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("s.csv", ".s.csv"))) == []


def test_predict_and_export_write_only_where_told_and_create_the_output_directory(tmp_path, monkeypatch):
    """Tables in memory: no scratch directory at all (one beside the checkpoint failed a read-only
    directory); every directory made is the output's."""
    import tempfile

    checkpoint, rows = _trained(tmp_path, skip=False)
    before = sorted(p.name for p in checkpoint.parent.iterdir())
    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(mkdtemp(*a, **k)) or made[-1])
    _write(tmp_path / "d.csv", rows)
    out = tmp_path / "new" / "deeper" / "s.parquet"  # a directory that does not exist: made before scoring
    assert main(["predict", "--checkpoint", str(checkpoint), "--data", str(tmp_path / "d.csv"), "--out", str(out)]) == 0
    assert pq.read_table(out).num_rows == len(rows)
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "e")]) == 0
    left = out.parent / ".s.parquet.tmp-999999999"  # (a pid no process has: a killed predict's temporary output)
    left.write_text("partial")
    assert main(["predict", "--checkpoint", str(checkpoint), "--data", str(tmp_path / "d.csv"), "--out", str(out)]) == 0
    assert not left.exists()  # removed at the next start
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == before  # nothing beside the checkpoint
    assert sorted(p.name for p in out.parent.iterdir()) == ["s.parquet"]
    assert [os.path.dirname(d) for d in made] == [str(tmp_path)]  # the export's own, beside --out (renamed to it)


def test_an_ssd_runs_scratch_is_on_its_file_system_away_from_the_checkpoint_and_a_killed_ones_is_removed(tmp_path):
    import tempfile

    from hetero.checkpoint import load_checkpoint
    from hetero.serving.restore import tier_scratch

    checkpoint, _ = _trained(tmp_path, skip=False)
    state = load_checkpoint(checkpoint)
    with tier_scratch(checkpoint, state, tmp_path) as scratch:
        assert scratch is None  # tables in memory: nothing made
    state["tier"] = {"groups": {}}  # (what a checkpoint with tables on the tier holds)
    system = Path(tempfile.gettempdir())
    where = system if os.stat(system).st_dev == os.stat(tmp_path).st_dev else tmp_path
    dead = where / ".hetero-scratch-999999999-left"  # (a pid no process has: a killed run's)
    dead.mkdir(exist_ok=True)
    with tier_scratch(checkpoint, state, tmp_path) as scratch:
        assert scratch.parent == where != checkpoint.parent and scratch.is_dir()
        assert not dead.exists()  # removed at the next start
    assert not scratch.exists()


@pytest.mark.parametrize("rows", [2_000_000])
def test_predict_memory_is_flat_in_the_row_count(tmp_path, monkeypatch, rows):
    """Resident memory after the last block is that after the first few (the old predict kept every
    score, label and id: ~60 bytes a row, 120 MB here)."""
    import hetero.predict as predict

    checkpoint, sample = _trained(tmp_path, skip=False)
    with open(tmp_path / "big.csv", "w") as f:
        f.write("key,y,city,age,note\n")
        block = "".join(f"{BIG + i},{y},{c},{a},{n}\n" for i, (_, y, c, a, n) in enumerate(sample))
        for _ in range(rows // len(sample)):
            f.write(block)
    seen = []
    write = predict.ScoreWriter.write

    def sampled(self, table):
        write(self, table)
        with open("/proc/self/status") as status:
            seen.append(next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")))

    monkeypatch.setattr(predict.ScoreWriter, "write", sampled)
    out = tmp_path / "s.parquet"
    assert main(["predict", "--checkpoint", str(checkpoint), "--data", str(tmp_path / "big.csv"), "--out", str(out),
                 "--id-column", "key"]) == 0
    assert pq.ParquetFile(out).metadata.num_rows == rows and len(seen) > 8
    warm = max(seen[: len(seen) // 4])
    # (KiB) the allocators move the resident set by up to 20 MiB from block to block with no growth
    # (4M rows: 828-861 MB, 841 at the end); keeping every row's id and score adds 60-120 MiB here
    assert max(seen) - warm < 32 * 1024, (warm, max(seen), seen)


def test_the_rows_skipped_as_bad_are_counted_in_metrics_json_and_the_last_log_line(tmp_path, capsys, caplog):
    import logging

    rows = _rows(400)
    data = tmp_path / "data.csv"
    bad = {5, 77, 300}
    data.write_text("key,y,city,age,note\n" + "".join(f"{k},{y},{c},{'x' if i in bad else a},{n}\n"
                                                      for i, (k, y, c, a, n) in enumerate(rows)))
    job = _job(tmp_path, data)
    job.write_text(job.read_text().replace("[data]\n", '[data]\non_bad_rows = "skip"\n'))
    with caplog.at_level(logging.INFO, logger="hetero"):
        assert main(["train", "--config", str(job), *TRAIN, "--run-dir", str(tmp_path / "run")]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert printed["bad_rows"] == saved["bad_rows"] == len(bad)
    last = caplog.records[-1].getMessage()
    assert last.startswith(f"hetero: {len(bad)} rows skipped as bad") and "line 7, column 'age'" in last, last
