"""Data larger than memory: a file streamed in blocks (sharded over ranks by bytes, resumable at a
sample) and the prepared columnar cache (``hetero data prepare``), each checked against the file
read whole into memory."""

import json

import pytest

from hetero.record import RECORD_KEY, RunRecord
import torch

from hetero.cli import main
from hetero.data.encode import fit, load_encoding
from hetero.data.prepare import load_prepared, prepare
from hetero.data.reader_config import FileFormat, ReaderConfig
from hetero.data.readers import read_table
from hetero.data.split import Split
from hetero.data.rows import BadRows
from hetero.data.schema import Categorical, Dense, Label, Schema, Transform
from hetero.data.shards import byte_shards, file_shards
from hetero.data.stream import StreamBatches, StreamConfig, StreamEval, fit_stream
from hetero.data.tabular import BatchConfig
from tests.conftest import run_ranks
from tests.test_jobfile import JOB, _clicks

# "row" is each line's number, a dense column passed through untransformed: it names the sample
SCHEMA = Schema(Label("clicked", positive=("yes", "1")),
                (Categorical("city"), Categorical("tags", separator="|"), Categorical("note", hash_buckets=64)),
                (Dense("row", Transform.NONE), Dense("age", Transform.STANDARDIZE)))


def _file(tmp_path, n=997, name="clicks.csv", seed=0):
    path = tmp_path / name
    _clicks(path, n, seed)
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = [lines[0] + ",row"] + [f"{line},{i}" for i, line in enumerate(lines[1:])]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def _parquet(tmp_path, n=997, group=64):
    """The rows of :func:`_file` as a Parquet file of ``group``-row row groups."""
    import pyarrow.csv as csv
    import pyarrow.parquet as pq

    path = tmp_path / "clicks.parquet"
    pq.write_table(csv.read_csv(_file(tmp_path, n)), path, row_group_size=group)
    return path


PARQUET = ReaderConfig(format=FileFormat.PARQUET)


def _rows(batches):
    return [int(r) for b in batches for r in b.dense[:, 0].tolist()]


def _stream(path, rank=0, world=1, window=100, block=4096, batch=24, shuffle=True, seed=1, reader=ReaderConfig()):
    enc = fit_stream(path, SCHEMA, reader)
    return StreamBatches(path, enc, reader, BatchConfig(batch, shuffle, seed, rank=rank, world_size=world),
                         StreamConfig(block_bytes=block, shuffle_window=window))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_read_disjoint_covering_shards(tmp_path, world):
    path = _file(tmp_path)
    shards = byte_shards(path, world, len(path.read_bytes().split(b"\n")[0]) + 1)
    assert shards[0][0] > 0 and shards[-1][1] == path.stat().st_size
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))  # no byte twice, none left out
    seen = []
    for rank in range(world):  # each rank's local batches (the per-step sum is a collective: below)
        got = _rows(_stream(path, rank, world, shuffle=False)._local(0, 0))
        assert got == sorted(got) and got  # its rows, in file order
        seen += got
    assert seen == list(range(997))


def test_resume_mid_file_is_sample_exact(tmp_path):
    path = _file(tmp_path)
    for rank, world in ((0, 1), (1, 3)):
        stream = _stream(path, rank, world, window=100, batch=24)
        whole = [b.dense[:, 0].tolist() for b in stream._local(2, 0)]
        assert sorted(r for b in whole for r in b) != [r for b in whole for r in b]  # shuffled
        for start in (1, 4, 5, len(whole) - 1):  # batches crossing window edges, the last one
            again = [b.dense[:, 0].tolist() for b in stream._local(2, start)]
            assert again == whole[start:], (rank, world, start)
        other = [b.dense[:, 0].tolist() for b in stream._local(3, 0)]
        assert other != whole  # another epoch, another order


@pytest.mark.parametrize("world", [1, 2, 3, 4, 20])
def test_a_parquet_file_streams_in_row_group_shards_and_resumes_exactly(tmp_path, world):
    path = _parquet(tmp_path)  # 16 row groups (15 of 64 rows, 1 of 37)
    shards = file_shards(path, PARQUET, world)
    assert shards[0][0] == 0 and shards[-1][1] == 16 and all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
    seen = []
    for rank in range(world):
        got = _rows(_stream(path, rank, world, batch=8 * world, shuffle=False, reader=PARQUET)._local(0, 0))
        assert got == sorted(got)
        seen += got
    assert seen == list(range(997))  # disjoint and covering (20 ranks: 4 have no row group)
    stream = _stream(path, world - 1 if world < 20 else 0, world, window=100, batch=8 * world, reader=PARQUET)
    whole = [b.dense[:, 0].tolist() for b in stream._local(1, 0)]
    for start in (1, 3, len(whole) - 1):
        assert [b.dense[:, 0].tolist() for b in stream._local(1, start)] == whole[start:]


def _stream_on_ranks(path, world):
    from hetero import parallel

    stream = _stream(path, parallel.rank(), world, window=64, batch=32)
    steps = [(b.global_size, b.dense[:, 0].tolist(), b.label.sum().item()) for b in stream.epoch(0)]
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, steps)
    return gathered


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_step_together_to_the_last_rank_and_cover_the_file_once(tmp_path, world):
    path = _file(tmp_path, n=997)
    per_rank = run_ranks(tmp_path, world, _stream_on_ranks, path, world)
    assert len({len(s) for s in per_rank}) == 1  # every rank takes the same number of steps
    for step in zip(*per_rank):
        assert {s[0] for s in step} == {sum(len(s[1]) for s in step)}  # the global size is the sum of the shares
    rows = sorted(int(r) for steps in per_rank for s in steps for r in s[1])
    assert rows == list(range(997))
    assert any(len(s[1]) == 0 for steps in per_rank for s in steps) or world == 2  # done ranks send empty shares


def test_evaluation_streams_the_whole_file_in_order(tmp_path):
    path = _file(tmp_path, n=300)
    enc = fit(SCHEMA, read_table(path, SCHEMA), "x")
    want = enc.encode(read_table(path, SCHEMA), "x")
    got = list(StreamEval(path, enc, ReaderConfig(), StreamConfig(block_bytes=4096)).batches(64))
    assert [len(b) for b in got] == [64] * 4 + [44]
    torch.testing.assert_close(torch.cat([b.dense for b in got]), want.dense)
    bags = [b.features["tags"] for b in got]
    assert torch.cat([b.values for b in bags]).tolist() == want.features["tags"].values.tolist()


def test_bad_rows_are_named_or_skipped_and_counted(tmp_path):
    path = _file(tmp_path, n=200)
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[150] = lines[150].rsplit(",", 1)[0] + ",x150"  # row 149: a value that is not a number
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    enc = fit(SCHEMA, read_table(path, SCHEMA, ReaderConfig(on_bad_rows=BadRows.SKIP)), "x")
    # the line number is the file's, also from the second rank's shard
    stream = StreamBatches(path, enc, ReaderConfig(), BatchConfig(10, rank=1, world_size=2), StreamConfig(4096))
    with pytest.raises(ValueError, match=r"clicks.csv: line 151, column 'row': 'x150' is not a number; fix the "
                                         r"value, declare the column categorical, or set on_bad_rows"):
        list(stream._local(0, 0))
    good, lines[150] = lines[150], "yes,Paris"  # a row of two fields instead
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"clicks.csv: CSV parse error: Expected 6 columns, got 2: yes,Paris; fix the "
                                         r"row, or set on_bad_rows = \"skip\""):
        list(StreamBatches(path, enc, ReaderConfig(), BatchConfig(10), StreamConfig(4096))._local(0, 0))
    lines[150], lines[180] = good, "yes,Paris"  # both
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    skip = StreamBatches(path, enc, ReaderConfig(on_bad_rows=BadRows.SKIP), BatchConfig(10, shuffle=False),
                         StreamConfig(block_bytes=4096))
    rows = _rows(skip._local(0, 0))
    assert rows == [r for r in range(200) if r not in (149, 179)] and skip.bad.rows == 2
    assert "a row of 2 fields, 6 expected: 'yes,Paris'" in skip.bad.first or "'x150' is not a number" in skip.bad.first


def test_a_csv_parse_error_reads_the_same_with_any_pyarrow(tmp_path, monkeypatch):
    # newer pyarrow numbers the row ("Row #N: ", counted in the byte range read, not the file): left out
    import pyarrow as pa
    import pyarrow.csv

    path = _file(tmp_path, n=20)

    def numbered(*args, **kwargs):
        raise pa.ArrowInvalid("CSV parse error: Row #7: Expected 6 columns, got 2: yes,Paris\nmore")

    monkeypatch.setattr(pyarrow.csv, "open_csv", numbered)
    with pytest.raises(ValueError) as e:
        read_table(path, SCHEMA)
    assert str(e.value) == f"{path}: CSV parse error: Expected 6 columns, got 2: yes,Paris; fix the row, or set " \
                           "on_bad_rows = \"skip\""


def _job(tmp_path, n=1500):
    """A job over train/valid/test files of a generated CSV (the split a stream needs)."""
    for name, seed, size in (("train.csv", 0, n), ("valid.csv", 1, 300), ("test.csv", 2, 300)):
        _clicks(tmp_path / name, size, seed)
    job = tmp_path / "job.toml"
    text = JOB.format(path=tmp_path / "train.csv").replace(
        "split = [0.7, 0.15, 0.15]", f'valid_path = "{tmp_path / "valid.csv"}"\ntest_path = "{tmp_path / "test.csv"}"')
    job.write_text(text.replace("epochs = 4", "epochs = 3"), encoding="utf-8")
    return job


def _metrics(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_prepared_cache_trains_exactly_as_the_file_read_into_memory(tmp_path, capsys):
    job = _job(tmp_path)
    assert main(["train", "--config", str(job), "--run-dir", str(tmp_path / "memory")]) == 0
    want = _metrics(capsys)
    assert main(["data", "prepare", "--config", str(job), "--out", str(tmp_path / "cache")]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 1500
    assert main(["train", "--config", str(job), "--prepared", str(tmp_path / "cache"),
                 "--run-dir", str(tmp_path / "prepared")]) == 0
    got = _metrics(capsys)
    assert got["test_auc"] == want["test_auc"] > 0.75
    assert (tmp_path / "prepared/losses.csv").read_text() == (tmp_path / "memory/losses.csv").read_text()
    saved = RunRecord.from_state(torch.load(tmp_path / "memory" / "checkpoint.pt")[RECORD_KEY], "memory")
    assert load_encoding(tmp_path / "cache") == saved.encoding  # the run's record, in its checkpoint
    assert main(["data", "prepare", "--config", str(job), "--out", str(tmp_path / "cache")]) == 1
    assert "cache exists: remove it or give another output directory" in capsys.readouterr().err


def test_a_prepared_cache_refuses_a_job_that_differs_and_records_what_it_trains_on(tmp_path, capsys):
    """--prepared never ignores the job: a schema, split, seed or data path other than the cache's
    is refused naming the key and both values, before the run directory is written; a job naming
    no data trains on the cache's settings and its config.toml records them."""
    import tomllib

    _clicks(tmp_path / "clicks.csv", 600, 0)
    text = JOB.format(path=tmp_path / "clicks.csv")
    job = tmp_path / "job.toml"
    job.write_text(text)
    assert main(["data", "prepare", "--config", str(job), "--out", str(tmp_path / "cache")]) == 0
    capsys.readouterr()
    changes = {"schema.categorical[1].min_count": text.replace("min_count = 2", "min_count = 3"),
               "data.split.fractions[1]": text.replace("[0.7, 0.15, 0.15]", "[0.7, 0.2, 0.1]"),
               "training.seed": text.replace("[train]\n", "[train]\nseed = 7\n"),
               "data.path": text.replace("clicks.csv", "other.csv")}
    (tmp_path / "other.csv").write_text((tmp_path / "clicks.csv").read_text())
    for key, changed in changes.items():
        assert changed != text, key
        (tmp_path / "changed.toml").write_text(changed)
        run = tmp_path / f"run_{key}"
        assert main(["train", "--config", str(tmp_path / "changed.toml"), "--prepared", str(tmp_path / "cache"),
                     "--run-dir", str(run)]) == 1, key
        err = capsys.readouterr().err.strip()
        assert f"was prepared from another job ({key}:" in err and len(err.splitlines()) == 1, err
        assert not run.exists(), key
    assert main(["train", "--prepared", str(tmp_path / "cache"), "--epochs", "1", "--run-dir",
                 str(tmp_path / "bare")]) == 0
    recorded = tomllib.loads((tmp_path / "bare" / "config.toml").read_text())
    assert recorded["data"]["path"] == str(tmp_path / "clicks.csv") and recorded["data"]["split"] == [0.7, 0.15, 0.15]
    assert recorded["schema"]["categorical"][0]["column"] == "city"
    assert main(["train", "--config", str(tmp_path / "bare" / "config.toml"), "--epochs", "1", "--run-dir",
                 str(tmp_path / "again")]) == 0  # the recorded job trains again, on the same cache


def test_a_random_prepared_split_is_disjoint_covering_and_fits_on_train_only(tmp_path):
    path = _file(tmp_path, n=2000)
    prepare(path, SCHEMA, tmp_path / "cache", split=Split((0.8, 0.1, 0.1)), seed=5)
    train, valid, test, enc = load_prepared(tmp_path / "cache")
    rows = [_rows(part.batches(128)) for part in (train, valid, test)]
    assert sorted(rows[0] + rows[1] + rows[2]) == list(range(2000))
    assert 1500 < len(rows[0]) < 1700 and len(rows[1]) > 100 and len(rows[2]) > 100
    table = read_table(path, SCHEMA)
    ref = fit(SCHEMA, table.take(rows[0]), "train")  # fitted on exactly the training rows
    assert enc.vocabularies["city"] == ref.vocabularies["city"] and enc.statistics == ref.statistics
    whole = ref.encode(table, "all")
    for part, index in zip((train, valid, test), rows):  # every value as the file read whole encodes it
        got = part.select(torch.arange(len(part)))
        want = whole.select(torch.tensor(index))
        for k in want.features:
            assert str(got.features[k]) == str(want.features[k]), k
        torch.testing.assert_close(got.dense, want.dense)
        torch.testing.assert_close(got.label, want.label)


def test_a_failed_prepare_leaves_nothing(tmp_path):
    path = _file(tmp_path, n=300)
    path.write_text(path.read_text(encoding="utf-8").replace(",250\n", ",x\n"), encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 252, column 'row': 'x' is not a number"):
        prepare(path, SCHEMA, tmp_path / "cache", split=Split((0.8, 0.1, 0.1)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clicks.csv"]
    with pytest.raises(ValueError, match=r"cannot sort it by a time column"):
        prepare(path, SCHEMA, tmp_path / "cache", split=Split(time_column="age"))


def test_a_streamed_run_resumed_mid_epoch_equals_the_uninterrupted_run(tmp_path, capsys):
    job = _job(tmp_path)
    common = ["train", "--config", str(job), "--stream", "--shuffle-window", "256"]
    assert main([*common, "--run-dir", str(tmp_path / "whole")]) == 0
    want = _metrics(capsys)
    assert main([*common, "--run-dir", str(tmp_path / "cut"), "--max-steps", "53"]) == 0  # mid-epoch 2 (47 a epoch)
    capsys.readouterr()
    assert main([*common, "--run-dir", str(tmp_path / "cut"), "--resume"]) == 0
    got = _metrics(capsys)
    assert got["test_auc"] == want["test_auc"] > 0.75 and got["steps"] == want["steps"] == 141
    assert (tmp_path / "cut/losses.csv").read_text() == (tmp_path / "whole/losses.csv").read_text()
    assert main([*common, "--run-dir", str(tmp_path / "cut"), "--resume", "--shuffle-window", "128"]) == 1
    assert "shuffle_window 256" in capsys.readouterr().err  # another order: refused, naming the setting


def test_predict_reproduces_the_test_auc_from_the_best_checkpoint(tmp_path, capsys):
    import pyarrow.parquet as pq
    from sklearn.metrics import roc_auc_score

    job = _job(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--config", str(job), "--epochs", "25", "--patience", "2", "--keep-best",
                 "--run-dir", str(run)]) == 0
    metrics = _metrics(capsys)
    assert metrics["best_epoch"] < metrics["epochs"]  # not the last epoch: the test split is scored with best.pt
    for out in (tmp_path / "scores.parquet", tmp_path / "scores.csv"):
        assert main(["predict", "--checkpoint", str(run / "best.pt"), "--data", str(tmp_path / "test.csv"),
                     "--out", str(out), "--config", str(job), "--batch-size", "100"]) == 0
        capsys.readouterr()
        scores = pq.read_table(out) if out.suffix == ".parquet" else __import__("pyarrow.csv").csv.read_csv(out)
        assert scores.num_rows == 300
        assert roc_auc_score(scores.column("label").to_numpy(), scores.column("score").to_numpy()) == \
            pytest.approx(metrics["test_auc"], abs=1e-9)
    lines = (tmp_path / "test.csv").read_text(encoding="utf-8").splitlines()  # the same rows, no label column
    (tmp_path / "new.csv").write_text("\n".join(line.split(",", 1)[1] for line in lines) + "\n", encoding="utf-8")
    unlabelled = tmp_path / "new.parquet"
    assert main(["predict", "--checkpoint", str(run / "best.pt"), "--data", str(tmp_path / "new.csv"),
                 "--out", str(unlabelled), "--config", str(job), "--batch-size", "100"]) == 0
    got = pq.read_table(unlabelled)
    assert got.column_names == ["score"]
    assert got.column("score").equals(pq.read_table(tmp_path / "scores.parquet").column("score"))
    last = tmp_path / "last.parquet"
    assert main(["predict", "--checkpoint", str(run / "checkpoint.pt"), "--data", str(tmp_path / "test.csv"),
                 "--out", str(last), "--config", str(job)]) == 0
    got = pq.read_table(last).column("score").to_numpy()
    assert not (got == pq.read_table(tmp_path / "scores.parquet").column("score").to_numpy()).all()  # another model
    assert main(["predict", "--checkpoint", str(run / "nope.pt"), "--data", str(tmp_path / "test.csv"),
                 "--out", str(last)]) == 1
    assert capsys.readouterr().err.strip().endswith("nope.pt does not exist")


def _predict_on_ranks(run, data, out):
    from hetero import parallel
    from hetero.predict import predict

    return predict(run / "checkpoint.pt", data, out, ReaderConfig(), 64, parallel.global_rank(), parallel.world_size())


def test_predict_on_ranks_equals_one_process(tmp_path, capsys):
    import pyarrow.parquet as pq

    job = _job(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--config", str(job), "--epochs", "1", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    one = tmp_path / "one.parquet"
    assert main(["predict", "--checkpoint", str(run / "checkpoint.pt"), "--data", str(tmp_path / "test.csv"),
                 "--out", str(one)]) == 0
    three = tmp_path / "three.parquet"
    run_ranks(tmp_path, 3, _predict_on_ranks, run, tmp_path / "test.csv", three)
    got, want = pq.read_table(three), pq.read_table(one)
    assert got.column("label").equals(want.column("label"))  # the same rows, in file order
    # (the same scores up to the matrix products' rounding at other batch compositions)
    torch.testing.assert_close(torch.tensor(got.column("score").to_numpy()),
                               torch.tensor(want.column("score").to_numpy()), rtol=1e-6, atol=1e-7)
    assert sorted(p.name for p in tmp_path.iterdir() if "part" in p.name) == []


def test_a_libffm_file_streams_in_disjoint_covering_shards(tmp_path):
    path = tmp_path / "clicks.libffm"
    path.write_text("".join(f"{i % 2} 0:{i % 7}:1 1:{i}:1\n" for i in range(500)), encoding="utf-8")
    schema = Schema(Label("label"), (Categorical("0"), Categorical("1")))
    reader = ReaderConfig(FileFormat.LIBFFM)
    enc = fit_stream(path, schema, reader)  # field 1's vocabulary in first appearance: line i is id i + 1
    seen = []
    for rank in range(3):
        stream = StreamBatches(path, enc, reader, BatchConfig(30, seed=0, rank=rank, world_size=3),
                               StreamConfig(block_bytes=4096, shuffle_window=64))
        seen += [int(i) - 1 for b in stream._local(0, 0) for i in b.features["1"].tolist()]
    assert sorted(seen) == list(range(500))


def test_the_criteo_example_config_trains_a_criteo_file(tmp_path, capsys):
    from pathlib import Path

    from tests.conftest import criteo_lines

    path = tmp_path / "train.txt"
    path.write_text(criteo_lines(600, seed=3))
    config = Path(__file__).resolve().parents[1] / "examples" / "criteo.toml"
    assert main(["train", "--config", str(config), "--data-path", str(path), "--batch-size", "64", "--hidden", "8",
                 "--no-progress", "--run-dir", str(tmp_path / "run")]) == 0
    assert _metrics(capsys)["steps"] == 8  # 480 training rows, batches of 64
    assert main(["data", "prepare", "--config", str(config), "--data-path", str(path), "--out",
                 str(tmp_path / "cache")]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] > 400


def test_a_stream_closed_early_stops_its_threads(tmp_path):
    import threading

    path = _file(tmp_path, n=2000)
    before = threading.active_count()
    batches = _stream(path, block=4096, window=64).epoch(0)
    next(batches)  # its reader, encoder and batching threads are running
    assert threading.active_count() > before
    batches.close()  # a max_steps stop
    assert threading.active_count() == before


def test_an_empty_training_stream_is_an_error_not_a_silent_epoch(tmp_path):
    path = _file(tmp_path, n=5)
    path.write_text(path.read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")  # the header only
    enc = fit(SCHEMA, read_table(_file(tmp_path, n=50, name="other.csv"), SCHEMA), "x")
    stream = StreamBatches(path, enc, ReaderConfig(), BatchConfig(8), StreamConfig(4096))
    with pytest.raises(ValueError, match=r"clicks.csv has no rows to train on"):
        list(stream.epoch(0))


def test_more_ranks_than_lines_leave_some_shards_empty(tmp_path):
    path = _file(tmp_path, n=2)
    shards = byte_shards(path, 4, len(path.read_bytes().split(b"\n")[0]) + 1)
    assert sum(a == b for a, b in shards) >= 1  # empty ranges
    rows = [_rows(_stream(path, r, 4, batch=4, shuffle=False)._local(0, 0)) for r in range(4)]
    assert sorted(r for part in rows for r in part) == [0, 1]


def test_part_files_stream_in_disjoint_covering_shards_and_resume_mid_epoch(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    for p in range(3):  # rows 0..449 over three part files of unequal length
        rows = range(p * 100, p * 100 + (50 if p == 1 else 200 if p == 2 else 100))
        (parts / f"part-{p}.csv").write_text("y,row\n" + "".join(f"{i % 2},r{i}\n" for i in rows))
    schema = Schema(Label("y"), (Categorical("row"),))
    reader = ReaderConfig()
    enc = fit_stream(parts, schema, reader)  # the vocabulary in first appearance over the files in order
    value = {k + 1: int(v[1:]) for k, v in enumerate(enc.vocabularies["row"])}
    want = sorted(int(line.split(",")[1][1:]) for f in sorted(parts.iterdir()) for line in f.read_text().splitlines()[1:])
    seen = []
    for rank in range(2):
        stream = StreamBatches(parts, enc, reader, BatchConfig(20, seed=0, rank=rank, world_size=2),
                               StreamConfig(block_bytes=4096, shuffle_window=16))
        batches = [b.features["row"].tolist() for b in stream._local(0, 0)]
        seen += [value[i] for b in batches for i in b]
        # from batch 8 (80 of the rank's rows: past its part of the first file): the same batches
        assert [b.features["row"].tolist() for b in stream._local(0, 8)] == batches[8:]
    assert sorted(seen) == want  # every row once over the ranks
