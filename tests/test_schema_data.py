"""A user's own file through a schema: CSV/TSV/Parquet on pyarrow, vocabularies from the
training split only, the stable hash, dense transforms, and the errors that name the fix."""

import numpy as np
import pytest
import torch

from hetero.data.encode import fit, hash_rows
from hetero.data.reader_config import FileFormat, ReaderConfig
from hetero.data.readers import read_table
from hetero.data.split import read_dataset
from hetero.data.rows import BadRows
from hetero.data.schema import Categorical, Cross, Dense, Label, Schema, Transform
from hetero.data.tabular import FeatureRole, Jagged

CSV = """clicked,city,tags,age,price,note
yes,"Zürich","a|b",31,10.5,x
no,東京,b,,3.0,y
yes,"New York, NY",a|c,45,,z
no,Zürich,,22,7.25,w
yes,Paris,c,27,1.0,v
"""
SCHEMA = Schema(Label("clicked", positive=("yes",)),
                (Categorical("city"), Categorical("tags", separator="|"), Categorical("note", hash_buckets=16)),
                (Dense("age", Transform.STANDARDIZE), Dense("price", Transform.LOG1P)),
                (Cross(("city", "note"), 32),))


def _fnv1a(text: str) -> int:  # the documented hash, written independently of the kernel
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h


def test_csv_with_quotes_unicode_empty_values_and_bags_reads_as_typed_columns(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_text(CSV, encoding="utf-8")
    table = read_table(path, SCHEMA)
    assert table.column("city").to_pylist() == ["Zürich", "東京", "New York, NY", "Zürich", "Paris"]
    assert table.column("tags").to_pylist() == ["a|b", "b", "a|c", None, "c"]  # an empty field is missing
    assert table.column("age").to_pylist() == [31, None, 45, 22, 27]
    assert table.column("price").to_pylist() == [10.5, 3.0, None, 7.25, 1.0]


def test_the_vocabulary_comes_from_the_training_rows_only(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_text(CSV, encoding="utf-8")
    table = read_table(path, SCHEMA)
    train, test = table.slice(0, 3), table.slice(3)  # "Paris" appears in the test rows only
    enc = fit(SCHEMA, train, "train")
    assert enc.vocabularies == {"city": ["Zürich", "東京", "New York, NY"], "tags": ["a", "b", "c"]}
    data = enc.encode(test, "test")
    assert data.features["city"].tolist() == [1, 0]  # Zürich is id 1; Paris, unseen in training, the OOV row 0
    bags = data.features["tags"]
    # an empty field is a bag of the OOV row; "c" (from the training row "a|c") is id 3
    assert isinstance(bags, Jagged) and bags.offsets.tolist() == [0, 1, 2] and bags.values.tolist() == [0, 3]
    assert data.label.tolist() == [0.0, 1.0]
    mean, std = np.mean([31, 45]), np.std([31, 45])  # the training rows' present ages
    torch.testing.assert_close(data.dense[:, 0], torch.tensor([(22 - mean) / std, (27 - mean) / std], dtype=torch.float32))
    torch.testing.assert_close(data.dense[:, 1], torch.log1p(torch.tensor([7.25, 1.0])))
    assert [(f.name, f.vocab_size, f.multi_hot, f.role) for f in data.specs] == [
        ("city", 4, False, FeatureRole.WIDE_AND_DEEP), ("tags", 4, True, FeatureRole.WIDE_AND_DEEP),
        ("note", 16, False, FeatureRole.WIDE_AND_DEEP), ("city_x_note", 32, False, FeatureRole.WIDE)]
    train_data = enc.encode(train, "train")  # a missing standardised value is the mean: 0
    assert train_data.dense[1, 0].item() == 0.0 and train_data.dense[2, 1].item() == 0.0


def test_the_hash_is_fnv1a_of_the_utf8_bytes_and_row_0_is_empty(tmp_path):
    import pyarrow as pa

    values = ["x", "Zürich", "東京", "", None, "a much longer value with spaces"]
    got = hash_rows(pa.array(values), 1000).tolist()
    want = [0 if not v else 1 + _fnv1a(v) % 999 for v in values]
    assert got == want
    assert hash_rows(pa.array(values[1:3] * 2).slice(2), 1000).tolist() == want[1:3]  # a sliced array
    path = tmp_path / "clicks.csv"
    path.write_text(CSV, encoding="utf-8")
    data = fit(SCHEMA, read_table(path, SCHEMA), "all").encode(read_table(path, SCHEMA), "all")
    assert data.features["note"].tolist() == [1 + _fnv1a(v) % 15 for v in "xyzwv"]
    assert data.features["city_x_note"][0].item() == 1 + _fnv1a("Zürich\x1fx") % 31


def test_tsv_without_a_header_and_parquet_read_the_same(tmp_path):
    import pyarrow.parquet as pq

    csv = tmp_path / "clicks.csv"
    csv.write_text(CSV, encoding="utf-8")
    lines = CSV.splitlines()[1:]
    tsv = tmp_path / "clicks.tsv"
    tsv.write_text("".join(line.replace('"New York, NY"', "New York, NY").replace(",", "\t").replace(
        "New York\t NY", "New York, NY") + "\n" for line in lines), encoding="utf-8")
    names = ("clicked", "city", "tags", "age", "price", "note")
    parquet = tmp_path / "clicks.parquet"
    pq.write_table(read_table(csv, SCHEMA), parquet)
    want = read_dataset(csv, SCHEMA, seed=3)
    for path, config in ((tsv, ReaderConfig(delimiter="\t", header=False, column_names=names)),
                         (parquet, ReaderConfig(FileFormat.PARQUET))):
        got = read_dataset(path, SCHEMA, config, seed=3)
        assert got[3].vocabularies == want[3].vocabularies
        for a, b in zip(got[:3], want[:3]):
            for k in b.features:
                assert str(a.features[k]) == str(b.features[k]), (path, k)
            torch.testing.assert_close(a.dense, b.dense)
            torch.testing.assert_close(a.label, b.label)


def test_a_threshold_label(tmp_path):
    path = tmp_path / "ratings.csv"
    path.write_text("user,item,rating\nu1,i1,5\nu2,i1,3\nu1,i2,4\n")
    schema = Schema(Label("rating", threshold=4), (Categorical("user"), Categorical("item")))
    table = read_table(path, schema)
    assert fit(schema, table, "r").encode(table, "r").label.tolist() == [1.0, 0.0, 1.0]


def test_bad_input_names_the_file_row_column_and_fix(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_text(CSV.replace("7.25", "seven"), encoding="utf-8")
    with pytest.raises(ValueError, match=r"clicks.csv: line 5, column 'price': 'seven' is not a number; fix the value, "
                                         r"declare the column categorical, or set on_bad_rows = \"skip\""):
        read_table(path, SCHEMA)
    with pytest.raises(ValueError, match=r"clicks.csv has no column 'country' that the schema names; its columns are "
                                         r"\['clicked', 'city', 'tags', 'age', 'price', 'note'\]"):
        read_table(path, Schema(Label("clicked"), (Categorical("country"),)))
    with pytest.raises(FileNotFoundError, match=r"data file .*missing.csv does not exist"):
        read_table(tmp_path / "missing.csv", SCHEMA)
    path.write_text("clicked,city\nyes,a\n,b\n")
    # an empty label is negative by default; without "" among the negative values it is a bad row
    schema = Schema(Label("clicked", positive=("yes",)), (Categorical("city"),))
    assert fit(schema, read_table(path, schema), "t").encode(read_table(path, schema), "t").label.tolist() == [1, 0]
    schema = Schema(Label("clicked", positive=("yes",), negative=("no",)), (Categorical("city"),))
    with pytest.raises(ValueError, match=r"clicks.csv: line 3, column 'clicked': None is neither of \['yes', 'no'\]"):
        read_table(path, schema)
    with pytest.raises(ValueError, match=r"dense 'age' transform 'log2' does not exist; valid values are "
                                         r"\['none', 'log1p', 'standardize'\]"):
        Dense("age", "log2")
    with pytest.raises(ValueError, match=r"cross 'city_x_age' joins \['age'\], which are not categorical features"):
        Schema(Label("y"), (Categorical("city"),), (Dense("age"),), (Cross(("city", "age"), 8),))
    with pytest.raises(ValueError, match=r"schema has dense columns \['age'\] more than once"):
        Schema(Label("y"), (Categorical("city"),), (Dense("age"), Dense("age", Transform.LOG1P)))
    with pytest.raises(ValueError, match=r"a CSV file without a header needs column_names"):
        ReaderConfig(header=False)


def test_read_dataset_fits_on_its_training_split_only(tmp_path):
    path = tmp_path / "unique.csv"
    path.write_text("y,city,row\n" + "".join(f"{i % 2},c{i},{i}\n" for i in range(100)))
    schema = Schema(Label("y"), (Categorical("city"),), (Dense("row", Transform.STANDARDIZE),))
    train, valid, test, enc = read_dataset(path, schema, seed=1)
    # the split's definition, in plain Python: row i's part by the i-th uniform draw of the seed
    u = np.random.default_rng(1).random(100)
    want = [[i for i in range(100) if lo <= u[i] < hi] for lo, hi in ((0, 0.8), (0.8, 0.9), (0.9, 1))]
    assert [len(train), len(valid), len(test)] == [len(w) for w in want]
    assert sorted((train.dense[:, 0] * enc.statistics["row"][1] + enc.statistics["row"][0]).round().int().tolist()) \
        == want[0]
    n = len(want[0])
    assert train.specs[0].vocab_size == n + 1 and sorted(train.features["city"].tolist()) == list(range(1, n + 1))
    assert valid.features["city"].tolist() == [0] * len(want[1]) and test.features["city"].tolist() == [0] * len(want[2])
    rows = train.dense[:, 0] * enc.statistics["row"][1] + enc.statistics["row"][0]  # undo the standardisation
    assert enc.statistics["row"][0] == pytest.approx(rows.double().mean().item(), abs=1e-4)  # the training rows' mean


def test_a_split_by_time_and_a_split_by_files(tmp_path):
    from hetero.data.split import Split

    path = tmp_path / "log.csv"
    rows = [(f"2026-01-{d:02d}T10:00", f"c{d}", d % 2) for d in (5, 1, 9, 3, 7, 2, 10, 4, 8, 6)]  # shuffled days
    path.write_text("ts,city,y\n" + "".join(f"{t},{c},{y}\n" for t, c, y in rows))
    schema = Schema(Label("y"), (Categorical("city"),))
    train, valid, test, enc = read_dataset(path, schema, split=Split((0.6, 0.2, 0.2), time_column="ts"))
    assert enc.vocabularies["city"] == ["c1", "c2", "c3", "c4", "c5", "c6"]  # the six earliest days train
    assert (len(valid), len(test)) == (2, 2) and test.features["city"].tolist() == [0, 0]  # days 9, 10: unseen
    assert test.label.tolist() == [1.0, 0.0]  # day 9, then day 10
    with pytest.raises(ValueError, match=r"log.csv has no column 'time' \(the split's time column\)"):
        read_dataset(path, schema, split=Split(time_column="time"))
    files = [tmp_path / f"{name}.csv" for name in ("train", "valid", "test")]
    for f, part in zip(files, (rows[:6], rows[6:8], rows[8:])):
        f.write_text("ts,city,y\n" + "".join(f"{t},{c},{y}\n" for t, c, y in part))
    train, valid, test, enc = read_dataset(files[0], schema, split=Split(valid_path=files[1], test_path=files[2]))
    assert (len(train), len(valid), len(test)) == (6, 2, 2) and enc.vocabularies["city"] == ["c5", "c1", "c9", "c3",
                                                                                              "c7", "c2"]
    with pytest.raises(ValueError, match=r"valid_path needs test_path"):
        Split(valid_path=files[1])
    with pytest.raises(ValueError, match=r"give two positive fractions summing to 1 \(train, validation: test_path"):
        Split(test_path=files[2])  # the test rows a file's: the training file splits in two
    with pytest.raises(ValueError, match=r"split fractions \[0.5, 0.5, 0.0\]: give three positive fractions"):
        Split((0.5, 0.5, 0.0))


def test_libsvm_and_libffm_read_as_categorical_columns(tmp_path):
    libfm = tmp_path / "clicks.libffm"
    libfm.write_text("1 0:17:1 1:5:1 2:9:1\n0 0:3:1 2:9:1 2:11:1\n1 1:5:1\n", encoding="utf-8")
    schema = Schema(Label("label"), (Categorical("0"), Categorical("1"), Categorical("2", separator="|")))
    config = ReaderConfig(FileFormat.LIBFFM)
    table = read_table(libfm, schema, config)
    assert table.column("label").to_pylist() == ["1", "0", "1"]
    assert table.column("0").to_pylist() == ["17", "3", None]  # a field the row lacks: missing
    assert table.column("2").to_pylist() == ["9", "9|11", None]  # a field twice: a bag
    data = fit(schema, table, "x").encode(table, "x")
    assert data.features["0"].tolist() == [1, 2, 0] and data.label.tolist() == [1.0, 0.0, 1.0]
    libsvm = tmp_path / "clicks.libsvm"
    libsvm.write_text("1 4:1 7:1\n0 7:1\n-1 2:1 4:1 9:1\n", encoding="utf-8")
    svm = Schema(Label("label", positive=("1",)), (Categorical("features", separator="|"),))
    table = read_table(libsvm, svm, ReaderConfig(FileFormat.LIBSVM))
    assert table.column("features").to_pylist() == ["4|7", "7", "2|4|9"]
    libsvm.write_text("1 4:1 7:1\n0 7:0.5\n1 2:1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"clicks.libsvm: line 2: '7:0.5' is not index:1; hetero reads libsvm "
                                         r"features as categorical ids of value 1"):
        read_table(libsvm, svm, ReaderConfig(FileFormat.LIBSVM))
    skipped = read_table(libsvm, svm, ReaderConfig(FileFormat.LIBSVM, on_bad_rows=BadRows.SKIP))
    assert skipped.column("features").to_pylist() == ["4|7", "2"]
