"""The built-in data sets as job files: side tables joined by key, features derived from a column
(a prefix, a number's bucket), crosses of multi-hot features (bags of every combination), header
names replaced, public data fetched by name. Checked against plain Python over the raw files."""

import dataclasses
import bisect
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hetero.cli import main
from hetero.data.encode import CROSS_JOIN, fit
from hetero.data.reader_config import Join, ReaderConfig
from hetero.data.readers import column_names, read_table, record_batches
from hetero.data.schema import Categorical, Cross, Dense, Label, Schema
from hetero.data.shards import byte_shards
from hetero.data.stream import StreamConfig, encoded_blocks
from hetero.data.tabular import Jagged
from hetero.config import read_job_file
from hetero.config.manager import locate

from conftest import EXAMPLES, criteo_job, movielens

CRITEO_SAMPLE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "criteo_kaggle_first8k.tsv"
AGE_GROUPS = (18, 25, 35, 45, 50, 56)


def _fnv1a(text: str) -> int:  # the documented hash, written independently of the kernel
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h


def _bucket(text: str, buckets: int) -> int:
    return 1 + _fnv1a(text) % (buckets - 1)


def _atomic(path):
    """A RecBole atomic file as dicts, by plain Python (the reference side of these tests)."""
    lines = path.read_text().splitlines()
    names = [h.split(":")[0] for h in lines[0].split("\t")]
    return [dict(zip(names, line.split("\t"))) for line in lines[1:] if line]


def _bags(col):
    return [col.values[a:b].tolist() for a, b in zip(col.offsets[:-1].tolist(), col.offsets[1:].tolist())]


def _movielens(ml_dir):
    """The demo's job file over ``ml_dir``: its schema, located source, and all rows encoded."""
    job = read_job_file(EXAMPLES / "movielens.toml")
    source = locate(dataclasses.replace(job, data=dataclasses.replace(job.data, dir=ml_dir))).data
    table = read_table(source.path, job.schema, source.reader)
    enc = fit(job.schema, table, "all")
    return job, source, enc, enc.encode(table, "all")


def test_the_movielens_job_file_encodes_as_plain_python_reads_the_atomic_files(ml_dir):
    job, _, enc, data = _movielens(ml_dir)
    users = {u["user_id"]: u for u in _atomic(ml_dir / "ml-100k.user")}
    items = {i["item_id"]: i for i in _atomic(ml_dir / "ml-100k.item")}
    ratings = _atomic(ml_dir / "ml-100k.inter")
    assert len(data) == len(ratings) == 1200

    def vocab_id(feature, value):
        values = enc.vocabularies[feature]
        return values.index(value) + 1 if value in values else 0

    crosses = {x.name: x for x in job.schema.crosses}
    ages = [float(users[r["user_id"]]["age"]) for r in ratings]
    years = [float(items[r["item_id"]]["release_year"]) if items[r["item_id"]]["release_year"].isdigit() else None
             for r in ratings]
    for n, r in enumerate(ratings):
        u, i = users[r["user_id"]], items[r["item_id"]]
        group = 1 + bisect.bisect_right(AGE_GROUPS, float(u["age"]))  # MovieLens-1M's age groups, 1..7
        genres = i["class"].split(" ") if i["class"] != "unknown" else [""]
        year = i["release_year"] if i["release_year"].isdigit() else ""
        want = {"user": vocab_id("user", r["user_id"]), "item": vocab_id("item", r["item_id"]), "age_group": group,
                "gender": vocab_id("gender", u["gender"]), "occupation": vocab_id("occupation", u["occupation"]),
                "zip3": vocab_id("zip3", u["zip_code"][:3]), "year": vocab_id("year", year)}
        for name, value in want.items():
            assert int(data.features[name][n]) == value, (n, name)
        assert _bags(data.features["genres"])[n] == [vocab_id("genres", g) for g in genres]
        assert data.label[n] == float(float(r["rating"]) >= 4)
        raw = {"user": [r["user_id"]], "genres": genres, "age_group": [str(group)], "gender": [u["gender"]],
               "occupation": [u["occupation"]], "item": [r["item_id"]]}
        for name, x in crosses.items():  # every combination of the crossed values, hashed
            a, b = x.columns
            want = [_bucket(f"{p}{CROSS_JOIN}{q}", x.hash_buckets) for p in raw[a] for q in raw[b]]
            col = data.features[name]
            assert (_bags(col)[n] if isinstance(col, Jagged) else [int(col[n])]) == want, (n, name)
    mean, std = np.mean(ages), np.std(ages)
    torch.testing.assert_close(data.dense[:, 0], torch.tensor([(a - mean) / std for a in ages], dtype=torch.float32))
    present = [y for y in years if y is not None]
    want_years = [(y - np.mean(present)) / np.std(present) if y is not None else 0.0 for y in years]
    torch.testing.assert_close(data.dense[:, 1], torch.tensor(want_years, dtype=torch.float32))
    sizes = {f.name: f.vocab_size for f in data.specs}
    assert sizes["age_group"] == 8 and sizes["user"] == len(users) + 1 and sizes["user_x_genres"] == 32768


def test_joined_rows_stream_in_shards_as_they_read_whole(ml_dir):
    _, source, enc, whole = _movielens(ml_dir)
    shards = byte_shards(source.path, 2, column_names(source.path, source.reader)[1])  # two ranks' bytes
    parts = [b for shard in shards
             for b in encoded_blocks(source.path, enc, source.reader, shard, StreamConfig(block_bytes=4096))]
    assert sum(len(p) for p in parts) == len(whole)
    for name in ("user", "zip3", "occupation_x_item"):
        assert torch.equal(torch.cat([p.features[name] for p in parts]), whole.features[name])
    assert torch.equal(torch.cat([p.dense for p in parts]), whole.dense)
    bags = [bag for p in parts for bag in _bags(p.features["user_x_genres"])]
    assert bags == _bags(whole.features["user_x_genres"])


def _files(tmp_path):
    (tmp_path / "clicks.csv").write_text("user,item,clicked\nu1,i1,1\nu2,i9,0\nu1,i2,1\nu3,i1,0\n")
    (tmp_path / "users.csv").write_text("user,city,age\nu1,Zürich,31\nu2,Lagos,\nu3,Lima,17\n")
    (tmp_path / "items.csv").write_text("item,tags\ni1,a|b\ni2,c\n")
    users = Join(tmp_path / "users.csv", "user")
    items = Join(tmp_path / "items.csv", "item")
    return tmp_path / "clicks.csv", ReaderConfig(joins=(users, items))


def test_a_left_join_keeps_the_rows_order_and_a_missing_key_reads_as_missing(tmp_path):
    path, reader = _files(tmp_path)
    schema = Schema(Label("clicked"), (Categorical("city"), Categorical("tags", separator="|"),
                                       Categorical("age", name="minor", boundaries=(18,))),
                    (Dense("age"),), (Cross(("city", "tags"), 64),))
    table = read_table(path, schema, reader)
    assert table.column("city").to_pylist() == ["Zürich", "Lagos", "Zürich", "Lima"]
    assert table.column("tags").to_pylist() == ["a|b", None, "c", "a|b"]  # item i9 is not in the side table
    data = fit(schema, table, "t").encode(table, "t")
    assert data.features["minor"].tolist() == [2, 0, 2, 1]  # 31 >= 18, missing, 31, 17 < 18
    assert data.dense[:, 0].tolist() == [31, 0, 31, 17]
    cross = data.features["city_x_tags"]  # a bag: the row's city with each of its tags
    want = [[_bucket(f"Zürich{CROSS_JOIN}a", 64), _bucket(f"Zürich{CROSS_JOIN}b", 64)],
            [_bucket(f"Lagos{CROSS_JOIN}", 64)], [_bucket(f"Zürich{CROSS_JOIN}c", 64)],
            [_bucket(f"Lima{CROSS_JOIN}a", 64), _bucket(f"Lima{CROSS_JOIN}b", 64)]]
    assert _bags(cross) == want


def test_a_cross_of_two_bags_is_every_pair(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("y,a,b\n1,p|q,r|s|t\n0,,u\n")
    schema = Schema(Label("y"), (Categorical("a", separator="|"), Categorical("b", separator="|")), (),
                    (Cross(("a", "b"), 1000),))
    data = fit(schema, read_table(path, schema), "t").encode(read_table(path, schema), "t")
    want = [[_bucket(f"{p}{CROSS_JOIN}{q}", 1000) for p in "pq" for q in "rst"], [_bucket(f"{CROSS_JOIN}u", 1000)]]
    assert _bags(data.features["a_x_b"]) == want
    assert [f.multi_hot for f in data.specs] == [True, True, True]


def test_prefix_and_a_column_feeding_two_features(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("y,zip\n1,85711\n0,8571\n1,T8H1N\n0,\n")
    schema = Schema(Label("y"), (Categorical("zip", name="zip3", prefix=3),
                                 Categorical("zip", name="zip_hashed", hash_buckets=8)))
    enc = fit(schema, read_table(path, schema), "t")
    assert enc.vocabularies == {"zip3": ["857", "T8H"]}
    data = enc.encode(read_table(path, schema), "t")
    assert data.features["zip3"].tolist() == [1, 1, 2, 0]
    assert data.features["zip_hashed"].tolist() == [_bucket(z, 8) for z in ("85711", "8571", "T8H1N")] + [0]


def test_joins_and_derived_features_name_the_fix(tmp_path):
    path, reader = _files(tmp_path)
    (tmp_path / "dup.csv").write_text("user,city\nu1,a\nu1,b\n")
    schema = Schema(Label("clicked"), (Categorical("city"),))
    with pytest.raises(ValueError, match=r"dup.csv: key user = 'u1' is on more than one row; a joined side table holds "
                                         r"one row per key"):
        read_table(path, schema, ReaderConfig(joins=(Join(tmp_path / "dup.csv", "user"),)))
    with pytest.raises(ValueError, match=r"items.csv has no column 'user', the key of the join"):
        read_table(path, schema, ReaderConfig(joins=(Join(tmp_path / "items.csv", "user"),)))
    (tmp_path / "clash.csv").write_text("user,item\nu1,i5\n")
    with pytest.raises(ValueError, match=r"clash.csv joins column 'item', which .*clicks.csv or an earlier join has "
                                         r"already: rename one"):
        read_table(path, schema, ReaderConfig(joins=(Join(tmp_path / "clash.csv", "user"),)))
    with pytest.raises(FileNotFoundError, match="nowhere.csv does not exist"):
        list(record_batches(path, schema, ReaderConfig(joins=(Join(tmp_path / "nowhere.csv", "user"),))))
    with pytest.raises(ValueError, match=r"boundaries \[3.0, 1.0\] must increase strictly"):
        Categorical("age", boundaries=(3, 1))
    with pytest.raises(ValueError, match=r"two features named \['city'\]: give each feature of one column its own name"):
        Schema(Label("y"), (Categorical("city"), Categorical("city", prefix=2)))
    with pytest.raises(ValueError, match=r"uses the label column 'y' as a feature"):
        Schema(Label("y"), (Categorical("y"),))
    with pytest.raises(ValueError, match=r"column_names gives 2 names, the header has 3 columns"):
        read_table(path, schema, ReaderConfig(column_names=("a", "b")))


def test_a_job_file_with_joins_fetch_and_renamed_headers_trains_and_predicts(ml_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *movielens(ml_dir), "--run-dir", str(run), "--epochs", "3", "--batch-size", "64",
                 "--no-progress", "--embedding-dim", "8", "--hidden", "16,8"]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["test_auc"] > 0.6  # the ratings depend on user and item (0.68 measured; chance: 0.5)
    out = tmp_path / "scores.csv"
    assert main(["predict", "--checkpoint", str(run / "checkpoint.pt"), "--data", str(ml_dir / "ml-100k.inter"),
                 "--config", str(EXAMPLES / "movielens.toml"), "--data-dir", str(ml_dir), "--out", str(out)]) == 0
    import pyarrow.csv as csv

    scores = csv.read_csv(out)
    ratings = _atomic(ml_dir / "ml-100k.inter")
    assert scores.column("label").to_pylist() == [int(float(r["rating"]) >= 4) for r in ratings]


def test_an_unknown_public_data_set_names_the_valid_ones(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text((EXAMPLES / "movielens.toml").read_text().replace('fetch = "movielens-100k"', 'fetch = "ml-1m"'))
    assert main(["train", "--config", str(job), "--run-dir", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hetero: error: fetch = 'ml-1m' is no public data set hetero knows; valid ones are ['movielens-100k'], or give "
        "path for your own files")
    assert not (tmp_path / "r").exists()


def test_hetero_train_without_a_job_file_names_the_demo_config(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hetero: error: hetero train needs data: --config job.toml with [data] and [schema] (examples/movielens.toml is "
        "the demo's), or --prepared DIR")


def test_a_malformed_ratings_line_names_the_file_and_the_fix(ml_dir, tmp_path, capsys):
    path = ml_dir / "ml-100k.inter"
    lines = path.read_text().splitlines()
    lines[5] = "3\t7"
    path.write_text("\n".join(lines) + "\n")
    assert main(["train", *movielens(ml_dir), "--run-dir", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"hetero: error: {path}: CSV parse error: Expected 4 columns, got 2")
    assert err.endswith("fix the row, or set on_bad_rows = \"skip\"")


def test_the_criteo_example_config_reads_criteo_lines(tmp_path):
    from conftest import criteo_lines

    path = tmp_path / "day.tsv"
    path.write_text(criteo_lines(50, seed=1))
    job = read_job_file(criteo_job(tmp_path, 1000))
    table = read_table(path, job.schema, job.data.reader)
    data = fit(job.schema, table, "t").encode(table, "t")
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    assert data.label.tolist() == [float(r[0]) for r in rows]
    want = [[np.log1p(max(int(v), 0)) if v else 0.0 for v in r[1:14]] for r in rows]
    torch.testing.assert_close(data.dense, torch.tensor(want, dtype=torch.float32))
    assert data.features["C7"].tolist() == [_bucket(r[20], 1000) if r[20] else 0 for r in rows]


@pytest.mark.skipif(not CRITEO_SAMPLE.is_file(), reason="shared Criteo sample not present")
def test_the_real_criteo_sample_reads_with_the_example_config():
    job = read_job_file(EXAMPLES / "criteo.toml")
    table = read_table(CRITEO_SAMPLE, job.schema, job.data.reader)
    data = fit(job.schema, table, "t").encode(table, "t")
    assert len(data) == 8000 and 0.1 < float(data.label.mean()) < 0.4 and data.num_dense == 13
