"""Every value read or refused clearly: labels outside their positive and negative sets, a
training split of one class, non-finite dense values, time splits by the column's own type, and
libFM files as their authors ship them (the Frappe layout) beside libFFM's."""

import json

import numpy as np
import pytest

from hetero.cli import main
from hetero.data.reader_config import FileFormat, ReaderConfig
from hetero.data.readers import read_table
from hetero.data.rows import BadRowCount, BadRows
from hetero.data.readers import record_batches
from hetero.data.schema import Categorical, Dense, Label, Schema, Transform
from hetero.data.split import Split, read_dataset


def _csv(path, header, rows):
    path.write_text(header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


def test_text_labels_map_by_their_sets_and_a_value_in_neither_is_named(tmp_path):
    path = _csv(tmp_path / "l.csv", "y,c", [("yes", "a"), ("No", "b"), (" YES ", "a"), ("", "b"), ("clicked", "a")])
    schema = Schema(Label("y", positive=("yes",)), (Categorical("c"),))
    with pytest.raises(ValueError, match=r"l.csv: line 6, column 'y': 'clicked' is neither of \['yes', '0', '-1', "
                                         r"'false', 'no', ''\]; add it to the label's positive values \(\['yes'\]\)"):
        read_table(path, schema)
    bad = BadRowCount()
    batches = list(record_batches(path, schema, ReaderConfig(on_bad_rows=BadRows.SKIP), bad=bad))
    assert bad.rows == 1 and sum(b.num_rows for b in batches) == 4
    train, *_ = read_dataset(path, schema, ReaderConfig(on_bad_rows=BadRows.SKIP), Split((0.98, 0.01, 0.01)), seed=0)
    assert sorted(train.label.tolist()) == sorted([1.0, 0.0, 1.0, 0.0][: len(train)])
    custom = Schema(Label("y", positive=("yes",), negative=("no", "clicked", "")), (Categorical("c"),))
    assert len(read_table(path, custom)) == 5


def test_a_training_split_of_one_class_is_refused_before_training(tmp_path, capsys):
    data = _csv(tmp_path / "d.csv", "y,c", [("yes" if i % 2 else "no", f"c{i % 5}") for i in range(200)])
    job = tmp_path / "job.toml"
    job.write_text(f'[data]\npath = "{data}"\n[schema]\nlabel = {{ column = "y", positive = ["1"], negative = '
                   f'["yes", "no"] }}\n[[schema.categorical]]\ncolumn = "c"\n')
    assert main(["train", "--config", str(job), "--run-dir", str(tmp_path / "run"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "(its training split): all " in err and " training rows are negative by the label column 'y' (positive " \
        "values ['1']): check the label's rule" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_non_finite_dense_values_are_named_skipped_or_filled(tmp_path, value):
    path = _csv(tmp_path / "d.csv", "y,x", [(1, 2.0), (0, value), (1, 3.0)])
    schema = Schema(Label("y"), (), (Dense("x", Transform.STANDARDIZE),))
    with pytest.raises(ValueError, match=r"d.csv: line 3, column 'x': [-\w.]+ is not a finite number; fix the value, "
                                         r"or say what it reads as: fill = 0.0 in the schema's dense 'x'"):
        read_table(path, schema)
    assert read_table(path, schema, ReaderConfig(on_bad_rows=BadRows.SKIP)).column("x").to_pylist() == [2.0, 3.0]
    filled = Schema(Label("y"), (), (Dense("x", Transform.LOG1P, fill=-1.0),))
    assert read_table(path, filled).column("x").to_pylist() == [2.0, -1.0, 3.0]


def test_a_time_split_orders_by_the_columns_own_type(tmp_path):
    days = [10, 9, 1, 30, 2, 20, 3, 7, 8, 11]
    path = _csv(tmp_path / "t.csv", "y,day", [(d % 2, d) for d in days])
    schema = Schema(Label("y"), (Categorical("day"),))  # the time column is also a categorical feature (text)
    train, valid, test, enc = read_dataset(path, schema, split=Split((0.6, 0.2, 0.2), time_column="day"))
    order = sorted(days)  # as numbers: the latest days are the test split
    assert sorted(enc.vocabularies["day"]) == sorted(str(d) for d in order[:6])
    assert test.features["day"].tolist() == [0, 0]  # days 20 and 30: unseen in training
    odd = _csv(tmp_path / "o.csv", "y,day", [(0, "x"), (1, "1")])
    with pytest.raises(ValueError, match=r"o.csv: time column 'day' holds 'x', neither a number nor an ISO-8601"):
        read_dataset(odd, schema, split=Split((0.5, 0.25, 0.25), time_column="day"))


def test_a_time_split_reads_dates_as_written_by_their_strptime_format(tmp_path, capsys):
    """TalkingData's ``click_time`` (``11/7/2017 9:30``: no zero padding), ordered as instants by
    ``time_format``: the latest clicks are the test split, not the latest in text order."""
    import random

    rng = random.Random(0)
    stamps = [(rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 23), rng.randint(0, 59)) for _ in range(300)]
    rows = [(i % 2, f"a{i % 7}", f"{m}/{d}/2017 {h}:{mi:02d}") for i, (m, d, h, mi) in enumerate(stamps)]
    path = _csv(tmp_path / "clicks.csv", "is_attributed,app,click_time", rows)
    job = tmp_path / "job.toml"
    job.write_text(f'[data]\npath = "{path}"\nsplit = [0.8, 0.1, 0.1]\ntime_column = "click_time"\n'
                   f'time_format = "%m/%d/%Y %H:%M"\n[schema]\nlabel = "is_attributed"\n'
                   f'[[schema.categorical]]\ncolumn = "app"\n[[schema.categorical]]\ncolumn = "click_time"\n')
    from hetero.config import read_job_file

    split = read_job_file(job).data.split
    schema = Schema(Label("is_attributed"), (Categorical("click_time"),))
    train, valid, test, enc = read_dataset(path, schema, split=split)
    latest = sorted(rows, key=lambda r: tuple(stamps[rows.index(r)][k] for k in (0, 1, 2, 3)))
    assert set(enc.vocabularies["click_time"]) == {r[2] for r in latest[:240]}  # the earliest 80% train
    assert main(["train", "--config", str(job), "--run-dir", str(tmp_path / "run"), "--no-progress", "--epochs", "1"]) == 0
    bad = _csv(tmp_path / "bad.csv", "is_attributed,app,click_time", rows + [(0, "a1", "2017-11-07 09:30")])
    with pytest.raises(ValueError, match=r"row 301 of the time column 'click_time' holds '2017-11-07 09:30', which "
                                         r"time_format = '%m/%d/%Y %H:%M' does not read"):
        read_dataset(bad, schema, split=split)


def test_libfm_files_as_shipped_and_libffm_files(tmp_path, capsys):
    # the Frappe release's layout: "label index:value", labels -1 / 1
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(300):
        a, b = rng.integers(0, 20), 20 + rng.integers(0, 10)
        y = 1 if (a + b) % 3 == 0 else -1
        lines.append(f"{y} {a}:1 {b}:1")
    data = tmp_path / "frappe.libfm"
    data.write_text("\n".join(lines) + "\n")
    job = tmp_path / "job.toml"
    job.write_text(f'[data]\npath = "{data}"\nformat = "libfm"\n[schema]\nlabel = "label"\n'
                   f'[[schema.categorical]]\ncolumn = "features"\nseparator = "|"\n')
    assert main(["train", "--config", str(job), "--run-dir", str(tmp_path / "run"), "--no-progress", "--epochs", "2",
                 "--batch-size", "32"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["test_auc"] is not None
    assert main(["predict", "--checkpoint", str(tmp_path / "run" / "checkpoint.pt"), "--data", str(data),
                 "--out", str(tmp_path / "s.csv")]) == 0
    assert len((tmp_path / "s.csv").read_text().splitlines()) == 301
    # a field-aware token in a libFFM file that lacks its field: named, or its row skipped
    ffm = tmp_path / "c.libffm"
    ffm.write_text("1 0:3:1 1:4:1\n0 0:3:1 7:1\n1 1:4:1\n")
    schema = Schema(Label("label"), (Categorical("0"), Categorical("1")))
    with pytest.raises(ValueError, match=r"c.libffm: line 2: '7:1' is not field:index:1"):
        read_table(ffm, schema, ReaderConfig(FileFormat.LIBFFM))
    table = read_table(ffm, schema, ReaderConfig(FileFormat.LIBFFM, on_bad_rows=BadRows.SKIP))
    assert table.column("0").to_pylist() == ["3", None] and table.column("label").to_pylist() == ["1", "1"]


def test_a_streamed_training_file_of_one_class_is_refused_before_its_first_evaluation(tmp_path, capsys):
    train = _csv(tmp_path / "train.csv", "y,c", [("no", f"c{i % 5}") for i in range(200)])
    held = _csv(tmp_path / "held.csv", "y,c", [("yes" if i % 2 else "no", f"c{i % 5}") for i in range(50)])
    job = tmp_path / "job.toml"
    job.write_text(f'[data]\npath = "{train}"\nvalid_path = "{held}"\ntest_path = "{held}"\n[schema]\n'
                   f'label = {{ column = "y", positive = ["yes"] }}\n[[schema.categorical]]\ncolumn = "c"\n'
                   f'hash_buckets = 16\n')
    assert main(["train", "--config", str(job), "--stream", "--run-dir", str(tmp_path / "run"), "--no-progress",
                 "--batch-size", "32"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"hetero: error: {train} (the training file): all 200 rows are negative by the label column "
                          f"'y': check the label's rule")
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
