"""A user's own data as it ships: categorical-only files train, resume and predict in memory,
prepared and streamed; one random split for every path; a prepared cache names its files by
position and is verified on load."""

import json
import random

import numpy as np
import pytest
import torch

from hetero.cli import main
from hetero.data.prepare import load_prepared, prepare
from hetero.data.reader_config import ReaderConfig
from hetero.data.schema import Categorical, Dense, Label, Schema
from hetero.data.split import Split, read_dataset

TRAIN = ["--epochs", "2", "--batch-size", "32", "--no-progress", "--embedding-dim", "4", "--hidden", "8"]


def _ids_csv(path, n=400, seed=0):
    """label, user, item: ids only, no dense column (the label follows the pair)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        u, i = rng.randint(0, 30), rng.randint(0, 20)
        rows.append(f"{int((u + i) % 3 == 0)},{u},{i}")
    path.write_text("label,user,item\n" + "\n".join(rows) + "\n")


IDS_JOB = """[data]
path = "{data}"
{extra}
[schema]
label = "label"
[[schema.categorical]]
column = "user"
[[schema.categorical]]
column = "item"
hash_buckets = 64
"""


def job_file(tmp_path, template, write_csv, stream=False):
    """``template`` (a job file with ``{data}`` and ``{extra}``) written for ``write_csv``'s
    training data, and with ``stream`` a validation and test file of 100 rows beside it:
    ``(data, job)`` paths."""
    data = tmp_path / "ids.csv"
    write_csv(data)
    extra = ""
    if stream:
        write_csv(tmp_path / "valid.csv", 100, seed=1)
        extra = f'valid_path = "{tmp_path / "valid.csv"}"\ntest_path = "{tmp_path / "valid.csv"}"'
    job = tmp_path / "job.toml"
    job.write_text(template.format(data=data, extra=extra))
    return data, job


def _last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["memory", "prepared", "stream"])
def test_a_categorical_only_csv_trains_resumes_and_predicts(tmp_path, capsys, mode):
    data, job = job_file(tmp_path, IDS_JOB, _ids_csv, stream=mode == "stream")
    run = tmp_path / "run"
    args = ["train", "--config", str(job), *TRAIN, "--run-dir", str(run)]
    if mode == "prepared":
        assert main(["data", "prepare", "--config", str(job), "--out", str(tmp_path / "cache")]) == 0
        args += ["--prepared", str(tmp_path / "cache")]
    elif mode == "stream":
        args += ["--stream"]
    assert main([*args, "--max-steps", "5"]) == 0
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    metrics = _last_json(capsys)
    assert metrics["test_auc"] is not None and metrics["epochs"] == 2
    assert main(["predict", "--checkpoint", str(run / "checkpoint.pt"), "--data", str(data),
                 "--out", str(tmp_path / "scores.csv")]) == 0
    scores = (tmp_path / "scores.csv").read_text().splitlines()
    assert len(scores) == 401 and scores[0] == '"score","label"'


def test_in_memory_and_prepared_paths_split_the_same_rows(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("y,row\n" + "".join(f"{i % 2},{i}\n" for i in range(2000)))
    schema = Schema(Label("y"), (), (Dense("row"),))
    split = Split((0.6, 0.3, 0.1))
    memory = read_dataset(path, schema, ReaderConfig(), split, seed=5)[:3]
    # a small block size: the file is read in many blocks, the draws continue across them
    prepared = load_prepared(prepare(path, schema, tmp_path / "cache", ReaderConfig(), split, seed=5,
                                     block_bytes=1 << 10))[:3]
    for part, (a, b) in enumerate(zip(memory, prepared)):
        rows_a, rows_b = a.dense[:, 0].tolist(), b.dense[:, 0].tolist()
        assert rows_a == rows_b, f"part {part}"
    u = np.random.default_rng(5).random(2000)  # the definition, in plain numpy
    assert memory[0].dense[:, 0].int().tolist() == [i for i in range(2000) if u[i] < 0.6]


def test_a_prepared_cache_names_files_by_position_and_is_verified_on_load(tmp_path):
    path = tmp_path / "bags.csv"
    path.write_text("y,a,b\n" + "".join(f"{i % 2},x{i % 5}|y{i % 3},z{i % 4}\n" for i in range(200)))
    schema = Schema(Label("y"), (Categorical("a", name="../../escape", separator="|"),
                                 Categorical("b", name="a/b", separator="|")))
    cache = prepare(path, schema, tmp_path / "deep" / "cache")
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and p != path)
    assert not (tmp_path / "escape.values.bin").exists() and all(f.startswith("deep/cache/") for f in files)
    train = load_prepared(cache)[0]
    assert set(train.multi_hot) == {"../../escape", "a/b"}
    target = cache / "train" / "bag1.values.bin"
    raw = bytearray(target.read_bytes())
    raw[3] ^= 1  # one bit flipped on disk
    target.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"bag1.values.bin does not match its checksum"):
        load_prepared(cache)


def test_int64_parquet_ids_hash_as_their_csv_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hetero.data.encode import fit

    ids = [42, 7, 123456789012, 42, 0]
    pq.write_table(pa.table({"y": ["1", "0", "1", "0", "1"], "user": pa.array(ids, pa.int64())}), tmp_path / "p.parquet")
    (tmp_path / "c.csv").write_text("y,user\n" + "".join(f"{y},{u}\n" for y, u in zip("10101", ids)))
    schema = Schema(Label("y"), (Categorical("user", hash_buckets=1000),))
    from hetero.data.reader_config import FileFormat
    from hetero.data.readers import read_table

    parquet = read_table(tmp_path / "p.parquet", schema, ReaderConfig(FileFormat.PARQUET))
    text = read_table(tmp_path / "c.csv", schema)
    got = [fit(schema, t, "x").encode(t, "x").features["user"].tolist() for t in (parquet, text)]
    # the documented hash in plain Python: 1 + fnv1a64(utf8(decimal text)) mod (buckets - 1)
    def fnv(s):
        h = 0xCBF29CE484222325
        for b in s.encode():
            h = ((h ^ b) * 0x100000001B3) % 2**64
        return 1 + h % 999

    assert got[0] == got[1] == [fnv(str(u)) for u in ids]


def test_inputs_as_users_have_them_parts_globs_lists_and_compressed_files(tmp_path, capsys):
    import gzip

    whole = tmp_path / "ids.csv"
    _ids_csv(whole, 300)
    header, *rows = whole.read_text().splitlines()
    parts = tmp_path / "parts"
    parts.mkdir()
    for i in range(3):
        (parts / f"part-{i:05d}.csv").write_text("\n".join([header, *rows[i * 100:(i + 1) * 100]]) + "\n")
    (parts / "_SUCCESS").write_text("")
    (tmp_path / "ids.csv.gz").write_bytes(gzip.compress(whole.read_bytes()))
    schema = Schema(Label("label"), (Categorical("user"), Categorical("item", hash_buckets=64)))
    want = read_dataset(whole, schema, seed=3)
    for k, path in enumerate((parts, str(parts / "part-*.csv"), tuple(parts / f"part-{i:05d}.csv" for i in range(3)),
                              tmp_path / "ids.csv.gz")):
        got = read_dataset(path, schema, seed=3)
        cached = [c.select(torch.arange(len(c))) for c in load_prepared(prepare(path, schema, tmp_path / f"cache{k}",
                                                                                 seed=3))[:3]]  # prepared too
        for a, b, c in zip(want[:3], got[:3], cached):
            assert a.features["user"].tolist() == b.features["user"].tolist() == c.features["user"].tolist(), path
            assert a.label.tolist() == b.label.tolist() == c.label.tolist()
    (tmp_path / "empty.csv").write_bytes(b"")
    job = tmp_path / "job.toml"
    job.write_text(IDS_JOB.format(data=tmp_path / "empty.csv", extra=""))
    assert main(["train", "--config", str(job), "--run-dir", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err == (f"hetero: error: {tmp_path / 'empty.csv'} is empty (no header line): give a file "
                                       f"with a header and rows, or set header = false and column_names\n")
    for data in (tmp_path / "ids.csv.gz", parts):  # streamed too (one process: a compressed file whole)
        job.write_text(IDS_JOB.format(data=data, extra=f'valid_path = "{whole}"\ntest_path = "{whole}"'))
        assert main(["train", "--config", str(job), "--run-dir", str(tmp_path / "run"), "--stream", "--overwrite",
                     "--no-progress", "--epochs", "1"]) == 0
    # ranks cut each file into byte ranges: a compressed one cannot be cut
    from hetero.data.shards import file_shards

    with pytest.raises(ValueError, match="a read sharded over ranks cuts one uncompressed file into byte ranges"):
        file_shards(tmp_path / "ids.csv.gz", ReaderConfig(), 2)


def _four_formats(tmp_path, kind):
    """A categorical-only file as its authors ship it, and the job file a user writes for it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 40, 400), rng.integers(0, 25, 400)
    y = ((a + b) % 3 == 0).astype(int)
    if kind == "libsvm":  # labels 0/1, "index:1" tokens
        path = tmp_path / "data.libsvm"
        path.write_text("".join(f"{t} {i}:1 {100 + j}:1\n" for t, i, j in zip(y, a, b)))
        return path, 'format = "libsvm"', '[[schema.categorical]]\ncolumn = "features"\nseparator = "|"\n', "label"
    if kind == "libfm":  # libFM's release layout (Frappe): labels -1/1
        path = tmp_path / "data.libfm"
        path.write_text("".join(f"{2 * t - 1} {i}:1 {100 + j}:1\n" for t, i, j in zip(y, a, b)))
        return path, 'format = "libfm"', '[[schema.categorical]]\ncolumn = "features"\nseparator = "|"\n', "label"
    if kind == "csv":
        path = tmp_path / "data.csv"
        path.write_text("clicked,user,item\n" + "".join(f"{t},{i},{j}\n" for t, i, j in zip(y, a, b)))
        cats = '[[schema.categorical]]\ncolumn = "user"\n[[schema.categorical]]\ncolumn = "item"\n'
        return path, "", cats, "clicked"
    path = tmp_path / "data.parquet"  # int64 ids, an int64 label
    pq.write_table(pa.table({"clicked": pa.array(y, pa.int64()), "user": pa.array(a * 1_000_003, pa.int64()),
                             "item": pa.array(b, pa.int64())}), path, row_group_size=100)
    cats = ('[[schema.categorical]]\ncolumn = "user"\nhash_buckets = 256\n'
            '[[schema.categorical]]\ncolumn = "item"\nhash_buckets = 64\n')
    return path, 'format = "parquet"', cats, "clicked"


@pytest.mark.parametrize("kind", ["libsvm", "libfm", "csv", "parquet"])
def test_categorical_only_files_as_shipped_train_resume_and_predict(tmp_path, capsys, kind):
    data, fmt, cats, label = _four_formats(tmp_path, kind)
    job = tmp_path / "job.toml"
    job.write_text(f'[data]\npath = "{data}"\n{fmt}\n[schema]\nlabel = "{label}"\n{cats}')
    run = tmp_path / "run"
    args = ["train", "--config", str(job), *TRAIN, "--run-dir", str(run)]
    assert main([*args, "--max-steps", "12"]) == 0
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    metrics = _last_json(capsys)
    assert metrics["epochs"] == 2 and metrics["test_auc"] is not None
    assert main(["predict", "--checkpoint", str(run / "checkpoint.pt"), "--data", str(data),
                 "--out", str(tmp_path / "scores.parquet")]) == 0
    printed = _last_json(capsys)
    assert printed["rows"] == 400 and printed["auc"] is not None
