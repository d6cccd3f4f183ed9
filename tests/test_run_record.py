"""A run directory that cannot lie: what reads a run back (model, encoding, reader settings,
configuration) lives in its checkpoints; a refused resume changes nothing on disk; predict reads
files as the run did, from any checkpoint file, with ids, metrics and empty shards."""

import hashlib
import json
import random
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import hetero_on_ranks
from hetero.cli import main
from hetero.record import RECORD_KEY, RunRecord

TRAIN = ["--epochs", "2", "--batch-size", "32", "--no-progress", "--embedding-dim", "4", "--hidden", "8"]


def _rows(n=500, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        city, age = rng.choice(["a", "b", "c", "unknown", "d"]), rng.randint(18, 70)
        y = int(rng.random() < (0.8 if city in "ab" else 0.2))
        out.append((f"k{i}", y, city, age, f"n{i}"))
    return out


def _write(path, rows):
    path.write_text("key,y,city,age,note\n" + "".join(f"{k},{y},{c},{a},{n}\n" for k, y, c, a, n in rows))


JOB = """[data]
path = "{data}"
null_values = ["unknown"]
[schema]
label = "y"
drop = ["note"]
[[schema.categorical]]
column = "city"
[[schema.categorical]]
column = "city"
name = "city_hashed"
hash_buckets = 16
[[schema.dense]]
column = "age"
transform = "{transform}"
"""


def _job(tmp_path, data, transform="standardize", name="job.toml"):
    job = tmp_path / name
    job.write_text(JOB.format(data=data, transform=transform))
    return job


def _snapshot(directory):
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _scores(tmp_path, checkpoint, data, *extra, out="scores.csv"):
    assert main(["predict", "--checkpoint", str(checkpoint), "--data", str(data), "--out", str(tmp_path / out),
                 *extra]) == 0
    return (tmp_path / out).read_text()


@pytest.mark.parametrize("change", ["rows_reordered", "transform_changed", "reader_changed"])
def test_a_refused_resume_changes_nothing_and_predict_scores_as_before(tmp_path, capsys, change):
    rows = _rows()
    data = tmp_path / "data.csv"
    _write(data, rows)
    job = _job(tmp_path, data)
    run = tmp_path / "run"
    assert main(["train", "--config", str(job), *TRAIN, "--max-steps", "20", "--run-dir", str(run)]) == 0
    before, scores = _snapshot(run), _scores(tmp_path, run / "checkpoint.pt", data)
    if change == "rows_reordered":  # the same rows in another order: another vocabulary order
        other = tmp_path / "shuffled.csv"
        _write(other, list(reversed(rows)))
        args = ["--config", str(job), "--data-path", str(other)]
    elif change == "transform_changed":
        args = ["--config", str(_job(tmp_path, data, "log1p", "other.toml"))]
    else:  # "unknown" read as a city, not as missing
        text = job.read_text().replace('null_values = ["unknown"]\n', "")
        (tmp_path / "other.toml").write_text(text)
        args = ["--config", str(tmp_path / "other.toml")]
    capsys.readouterr()
    assert main(["train", *args, *TRAIN, "--resume", "--run-dir", str(run)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hetero: error: checkpoint ") and err.count("\n") == 1, err
    assert _snapshot(run) == before  # nothing written, nothing replaced
    assert _scores(tmp_path, run / "checkpoint.pt", data) == scores


def test_predict_reads_files_with_the_runs_reader_settings_from_any_checkpoint_file(tmp_path, capsys):
    data = tmp_path / "data.csv"
    _write(data, _rows())
    job = _job(tmp_path, data)
    run = tmp_path / "run"
    assert main(["train", "--config", str(job), *TRAIN, "--run-dir", str(run)]) == 0
    with_config = _scores(tmp_path, run / "checkpoint.pt", data, "--config", str(job), out="a.csv")
    # no --config: the run's null_values from its checkpoint ("unknown" is missing, as in training)
    assert _scores(tmp_path, run / "checkpoint.pt", data, out="b.csv") == with_config
    # the checkpoint alone, elsewhere, beside nothing
    elsewhere = tmp_path / "models" / "model.pt"
    elsewhere.parent.mkdir()
    shutil.copy(run / "checkpoint.pt", elsewhere)
    assert _scores(tmp_path, elsewhere, data, out="c.csv") == with_config
    record = RunRecord.from_state(torch.load(elsewhere)[RECORD_KEY], elsewhere)
    assert record.reader.null_values == ("unknown",) and record.config["optimizer"]["deep_lr"] == 0.01
    assert record.model.kind == "wide_deep" and record.encoding.schema.drop == ("note",)
    # a job file that reads the file otherwise is refused, naming the setting
    other = tmp_path / "other.toml"
    other.write_text(job.read_text().replace('null_values = ["unknown"]\n', ""))
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(elsewhere), "--data", str(data), "--out", str(tmp_path / "d.csv"),
                 "--config", str(other)]) == 1
    assert "hetero: error: the job file's [data] null_values = [] reads files otherwise than the run did" in \
        capsys.readouterr().err


def test_predict_needs_no_dropped_column_carries_ids_and_reports_metrics(tmp_path, capsys):
    rows = _rows()
    data = tmp_path / "data.csv"
    _write(data, rows)
    run = tmp_path / "run"
    assert main(["train", "--config", str(_job(tmp_path, data)), *TRAIN, "--run-dir", str(run)]) == 0
    bare = tmp_path / "bare.csv"  # no "note" (dropped) column
    bare.write_text("key,y,city,age\n" + "".join(f"{k},{y},{c},{a}\n" for k, y, c, a, _ in rows))
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(run / "checkpoint.pt"), "--data", str(bare),
                 "--out", str(tmp_path / "s.parquet"), "--id-column", "key"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    table = pq.read_table(tmp_path / "s.parquet")
    assert table.column_names == ["key", "score", "label"]
    assert table.column("key").to_pylist() == [r[0] for r in rows]
    from sklearn.metrics import roc_auc_score

    assert printed["rows"] == 500
    assert printed["auc"] == pytest.approx(roc_auc_score([r[1] for r in rows], table.column("score").to_numpy()))
    assert printed["logloss"] > 0


def test_predict_at_two_ranks_with_an_empty_shard_writes_csv(tmp_path):
    rows = _rows(200)
    single = tmp_path / "one_group.parquet"  # one row group: rank 1's shard is empty
    pq.write_table(pa.table({"key": [r[0] for r in rows], "y": [str(r[1]) for r in rows],
                             "city": [r[2] for r in rows], "age": [float(r[3]) for r in rows],
                             "note": [r[4] for r in rows]}), single)
    job = tmp_path / "pq.toml"
    job.write_text(JOB.format(data=single, transform="none").replace('path = "', 'format = "parquet"\npath = "'))
    run = tmp_path / "run"
    assert main(["train", "--config", str(job), *TRAIN, "--run-dir", str(run)]) == 0
    ranks = hetero_on_ranks(tmp_path, 2, ["predict", "--checkpoint", str(run / "checkpoint.pt"), "--data", str(single),
                                          "--out", str(tmp_path / "s.csv"), "--id-column", "key"])
    assert ranks.returncode == 0, ranks.stderr[-2000:]
    lines = (tmp_path / "s.csv").read_text().splitlines()
    assert lines[0] == '"key","score","label"' and len(lines) == 201
    assert [line.split(",")[0].strip('"') for line in lines[1:]] == [r[0] for r in rows]


def test_a_merged_sharded_checkpoint_scores_anywhere(tmp_path, capsys):
    data = tmp_path / "data.csv"
    _write(data, _rows())
    run = tmp_path / "run"
    assert main(["train", "--config", str(_job(tmp_path, data)), *TRAIN, "--checkpoint-format", "sharded",
                 "--run-dir", str(run)]) == 0
    merged = tmp_path / "elsewhere" / "model.pt"
    merged.parent.mkdir()
    assert main(["checkpoint", "merge", str(run / "checkpoint.dcp"), str(merged)]) == 0
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(merged), "--data", str(data), "--out", str(tmp_path / "s.csv")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == 500
    assert main(["export", "--checkpoint", str(run / "checkpoint.dcp"), "--out", str(tmp_path / "e")]) == 1
    err = capsys.readouterr().err.strip()  # as predict does: merge it first
    assert "is a sharded checkpoint: merge it into one file with `hetero checkpoint merge" in err and \
        len(err.splitlines()) == 1 and not (tmp_path / "e").exists(), err
    assert main(["export", "--checkpoint", str(merged), "--out", str(tmp_path / "e")]) == 0
