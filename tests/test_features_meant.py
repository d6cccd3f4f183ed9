"""A feature that cannot be what the user meant is refused before training: a libFM / libsvm bag
takes its format's separator by default, a vocabulary feature of nearly one value per row is
refused (warned above half), a job with no feature is refused."""

import json
import logging
import tomllib

import numpy as np

from hetero.cli import main


def _frappe(path, n=1500, seed=0):
    """The Frappe release's layout ("label index:value", labels -1 / 1): two ids a line of a
    20 x 10 vocabulary, the label a rule of both."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        a, b = rng.integers(0, 20), 20 + rng.integers(0, 10)
        lines.append(f"{1 if (a + b) % 3 == 0 else -1} {a}:1 {b}:1")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_libfm_file_without_a_separator_key_trains_on_its_ids(tmp_path, capsys):
    data = _frappe(tmp_path / "frappe.libfm")
    got = {}
    for name, extra in (("bare", ""), ("explicit", 'separator = "|"\n')):
        job = tmp_path / f"{name}.toml"
        job.write_text(f'[data]\npath = "{data}"\nformat = "libfm"\n[schema]\nlabel = "label"\n'
                       f'[[schema.categorical]]\ncolumn = "features"\n{extra}')
        assert main(["train", "--config", str(job), "--run-dir", str(tmp_path / name), "--no-progress", "--epochs", "3",
                     "--batch-size", "64"]) == 0
        got[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["test_auc"]
    assert got["bare"] == got["explicit"] > 0.6  # (read whole, each line one value: 0.5)
    recorded = tomllib.loads((tmp_path / "bare" / "config.toml").read_text())
    assert recorded["schema"]["categorical"][0]["separator"] == "|"  # the run records what it used


def test_a_feature_of_nearly_one_value_per_row_and_a_job_without_features_are_refused(tmp_path, capsys, caplog):
    rng = np.random.default_rng(0)
    rows = [(i, int(rng.random() < 0.3), f"c{rng.integers(0, 5)}", f"h{i % 1000}") for i in range(1600)]
    data = tmp_path / "d.csv"
    data.write_text("id,y,city,half\n" + "".join(f"{i},{y},{c},{h}\n" for i, y, c, h in rows))
    base = f'[data]\npath = "{data}"\n[schema]\nlabel = "y"\n[[schema.categorical]]\ncolumn = "city"\n'
    cases = {"id": base + '[[schema.categorical]]\ncolumn = "id"\n', "none": f'[data]\npath = "{data}"\n[schema]\nlabel = "y"\n'}
    for name, text in cases.items():
        (tmp_path / f"{name}.toml").write_text(text)
        assert main(["train", "--config", str(tmp_path / f"{name}.toml"), "--run-dir", str(tmp_path / name),
                     "--no-progress", "--epochs", "1"]) == 1, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and not (tmp_path / name).exists(), err
        assert ("categorical 'id' has" in err and "drop it" in err) if name == "id" else "has no feature" in err, err
    (tmp_path / "half.toml").write_text(base + '[[schema.categorical]]\ncolumn = "half"\n')  # ~800 of ~1280: warned
    with caplog.at_level(logging.WARNING, logger="hetero"):
        assert main(["train", "--config", str(tmp_path / "half.toml"), "--run-dir", str(tmp_path / "half"),
                     "--no-progress", "--epochs", "1"]) == 0
    assert any("categorical 'half' has" in r.getMessage() for r in caplog.records)


def test_any_legal_column_name_is_a_feature_name_everywhere(tmp_path, capsys):
    """``user.id`` (no torch module name holds a dot), ``page/section`` (a path) and ``..``: train in
    memory and on the SSD tier, resume, predict and export; the export names the features as the
    user did, and no file or directory lies outside the run's, the store's or the export's."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    rows = [(int(rng.random() < 0.4), f"u{rng.integers(0, 30)}", f"p{rng.integers(0, 8)}", f"x{rng.integers(0, 5)}")
            for _ in range(600)]
    data = tmp_path / "d.csv"
    data.write_text("y,user.id,page/section,..\n" + "".join(f"{y},{u},{p},{x}\n" for y, u, p, x in rows))
    job = tmp_path / "job.toml"
    job.write_text(f'[data]\npath = "{data}"\n[schema]\nlabel = "y"\n[[schema.categorical]]\ncolumn = "user.id"\n'
                   f'[[schema.categorical]]\ncolumn = "page/section"\n[[schema.categorical]]\ncolumn = ".."\n')
    scores = {}
    for name, extra in (("memory", []), ("ssd", ["--table-storage", "ssd", "--cache-mb", "1"])):
        run = tmp_path / "runs" / name
        args = ["train", "--config", str(job), "--no-progress", "--epochs", "2", "--embedding-dim", "4", "--hidden", "8",
                "--patience", "0", "--run-dir", str(run), *extra]
        assert main([*args, "--max-steps", "5"]) == 0
        assert main([*args, "--resume"]) == 0
        assert main(["predict", "--checkpoint", str(run / "checkpoint.pt"), "--data", str(data),
                     "--out", str(tmp_path / f"{name}.csv")]) == 0
        assert main(["export", "--checkpoint", str(run / "checkpoint.pt"), "--out", str(tmp_path / "exports" / name)]) == 0
        scores[name] = (tmp_path / f"{name}.csv").read_text()
        manifest = json.loads((tmp_path / "exports" / name / "manifest.json").read_text())
        assert {t["feature"] for t in manifest["tables"].values()} == {"user.id", "page/section", ".."}
        for table, entry in manifest["tables"].items():
            exported = pq.read_table(tmp_path / "exports" / name / "tables" / f"{table}.parquet")
            column = {"user.id": 1, "page/section": 2, "..": 3}[entry["feature"]]
            values = exported.column("value").to_pylist()  # each id's raw value: the vocabulary, id 0 none
            assert values[0] is None and set(values[1:]) <= {r[column] for r in rows}
            ids = exported.column("key").to_pylist()
            assert ids == list(range(len(values)))
            # the id the run's encoder gives each value is the row the export names by it
            import pyarrow as pa
            import torch

            from hetero.record import RECORD_KEY, RunRecord

            record = RunRecord.from_state(torch.load(run / "checkpoint.pt")[RECORD_KEY], "run")
            enc, feature = record.encoding, entry["feature"]
            batch = {c: pa.array([values[1]] * 2) for c in record.encoding.schema.columns}
            batch[feature] = pa.array(values[1:], pa.string())
            for c in batch:
                batch[c] = batch[c] if c == feature else pa.array([str(values[1])] * (len(values) - 1))
            batch["y"] = pa.array(["0"] * (len(values) - 1))
            encoded = enc.encode(pa.table(batch), "values")
            assert encoded.features[feature].tolist() == ids[1:], feature
    assert scores["memory"] == scores["ssd"]
    made = {p.relative_to(tmp_path).parts[0] for p in tmp_path.rglob("*")}
    assert made == {"d.csv", "job.toml", "runs", "exports", "memory.csv", "ssd.csv"}, made
    for p in (tmp_path / "runs" / "ssd" / "ssd").rglob("*"):  # the store: flat, one directory per table group
        assert len(p.relative_to(tmp_path / "runs" / "ssd" / "ssd").parts) <= 2, p
    capsys.readouterr()


def test_values_no_run_can_use_are_one_line_errors_before_anything_is_written(tmp_path, capsys):
    data = tmp_path / "d.csv"
    data.write_text("y,c\n" + "".join(f"{i % 2},c{i % 5}\n" for i in range(200)))
    job = tmp_path / "job.toml"
    job.write_text(f'[data]\npath = "{data}"\n[schema]\nlabel = "y"\n[[schema.categorical]]\ncolumn = "c"\n')
    cases = {("--table-storage", "ssd", "--cache-mb", "inf"): "tables.cache_mb (--cache-mb) = inf: give a finite number",
             ("--seed", "-1"): "training.seed (--seed) = -1: give a value >= 0 and < 4294967296",
             ("--seed", str(2**32)): "training.seed (--seed) = 4294967296: give a value in [0, 4294967296)",
             ("--embedding-dim", str(10**12)): "does not fit in host memory"}
    for args, message in cases.items():
        run = tmp_path / "run"
        assert main(["train", "--config", str(job), "--no-progress", "--epochs", "1", "--run-dir", str(run), *args]) == 1
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1 and err.startswith("hetero: error: "), err
        assert not run.exists(), args


def test_the_python_api_infers_a_files_format_as_the_cli_does(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hetero.data.schema import Categorical, Label, Schema
    from hetero.data.split import Split, read_dataset

    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"y": rng.integers(0, 2, 300), "c": [f"c{i % 7}" for i in range(300)]}),
                   tmp_path / "p.parquet")
    train, valid, test, enc = read_dataset(tmp_path / "p.parquet", Schema(Label("y"), (Categorical("c"),)),
                                           split=Split((0.8, 0.1, 0.1)))
    assert len(train) + len(valid) + len(test) == 300 and sorted(enc.vocabularies["c"]) == [f"c{i}" for i in range(7)]
    job = tmp_path / "job.toml"  # a job file naming no format: the name says Parquet, and config.toml records it
    job.write_text(f'[data]\npath = "{tmp_path / "p.parquet"}"\n[schema]\nlabel = "y"\n[[schema.categorical]]\n'
                   f'column = "c"\n')
    assert main(["train", "--config", str(job), "--no-progress", "--epochs", "1", "--run-dir", str(tmp_path / "r")]) == 0
    assert 'format = "parquet"' in (tmp_path / "r" / "config.toml").read_text()
    frappe = _frappe(tmp_path / "f.libfm", n=300)  # a libFM file named so: its format and its bags' separator
    train, *_ = read_dataset(frappe, Schema(Label("label"), (Categorical("features"),)), split=Split((0.8, 0.1, 0.1)))
    assert train.features["features"].values.numel() == 2 * len(train)  # two ids a line, not one value
