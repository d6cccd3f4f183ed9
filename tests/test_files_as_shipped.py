"""Files as their authors ship them: Avazu's train.csv has a header and its dev.csv / test.csv have
none (reader settings per file: valid_path / test_path as tables); a test file with validation
drawn from the training file (split = [0.9, 0.1]); the reader and split keys from the command line
(--data.valid_path ...) as from a job file."""

import json
import tomllib

import numpy as np
import pytest

from hetero.cli import main
from hetero.config import load_job

NAMES = ["id", "click", "hour", "site_id", "app_id", "device_type"]


def _avazu(tmp_path, n=900, seed=0):
    """Three files in Avazu's layout: train.csv with a header, dev.csv and test.csv without; 64-bit ids."""
    rng = np.random.default_rng(seed)

    def rows(k, start):
        out = []
        for i in range(k):
            site, app = rng.integers(0, 12), rng.integers(0, 6)
            click = int(rng.random() < (0.7 if site < 6 else 0.15))
            out.append(f"{10000174058809263569 + start + i},{click},{14102100 + i % 24},s{site},a{app},{i % 3}")
        return out

    (tmp_path / "train.csv").write_text(",".join(NAMES) + "\n" + "\n".join(rows(n, 0)) + "\n")
    (tmp_path / "dev.csv").write_text("\n".join(rows(200, n)) + "\n")
    (tmp_path / "test.csv").write_text("\n".join(rows(200, n + 200)) + "\n")


SCHEMA = """[schema]
label = "click"
[[schema.categorical]]
column = "site_id"
[[schema.categorical]]
column = "app_id"
[[schema.categorical]]
column = "device_type"
"""


def _headerless(path):
    return f'{{ path = "{path}", header = false, column_names = {json.dumps(NAMES)} }}'


def test_avazus_three_files_as_shipped_train_with_per_file_reader_settings(tmp_path, capsys):
    _avazu(tmp_path)
    job = tmp_path / "avazu.toml"
    job.write_text(f'[data]\npath = "train.csv"\nvalid_path = {_headerless("dev.csv")}\n'
                   f'test_path = {_headerless("test.csv")}\n{SCHEMA}')
    args = ["--no-progress", "--epochs", "2", "--embedding-dim", "4", "--hidden", "8", "--data-dir", str(tmp_path)]
    assert main(["train", "--config", str(job), *args, "--run-dir", str(tmp_path / "run")]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["test_auc"] > 0.6  # the header-less files read as rows, every one of them scored
    recorded = tomllib.loads((tmp_path / "run" / "config.toml").read_text())["data"]
    assert recorded["valid_path"]["header"] is False and recorded["test_path"]["column_names"] == NAMES
    assert main(["train", "--config", str(tmp_path / "run" / "config.toml"), "--no-progress", "--run-dir",
                 str(tmp_path / "again")]) == 0  # the recorded job trains the same again
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["test_auc"] == got["test_auc"]
    # predict reads the header-less test file as the run read it (its own reader settings, recorded)
    assert main(["predict", "--checkpoint", str(tmp_path / "run" / "best.pt"), "--data", str(tmp_path / "test.csv"),
                 "--out", str(tmp_path / "s.csv"), "--id-column", "id"]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["rows"] == 200 and abs(scored["auc"] - got["test_auc"]) < 1e-6
    ids = (tmp_path / "s.csv").read_text().splitlines()[1:]
    assert [line.split(",")[0].strip('"') for line in ids] == [line.split(",")[0] for line in
                                                               (tmp_path / "test.csv").read_text().splitlines()]
    # one reader setting for all files: the header-less dev.csv's first row is taken for its header
    (tmp_path / "one.toml").write_text(f'[data]\npath = "train.csv"\nvalid_path = "dev.csv"\ntest_path = "test.csv"\n'
                                       f'{SCHEMA}')
    assert main(["train", "--config", str(tmp_path / "one.toml"), *args, "--run-dir", str(tmp_path / "one")]) == 1
    assert "has no column" in capsys.readouterr().err  # (refused, naming the file's columns: never read wrong)


def test_a_test_file_with_validation_drawn_from_the_training_file_and_data_keys_on_the_command_line(tmp_path, capsys):
    _avazu(tmp_path)
    job = tmp_path / "job.toml"
    job.write_text(f'[data]\npath = "train.csv"\n{SCHEMA}')
    cli = ["--data.split", "[0.9, 0.1]", "--data.test-path", _headerless("test.csv"), "--data-dir",
           str(tmp_path)]
    from hetero.config.manager import locate

    parsed = locate(load_job(["--config", str(job), *cli])).data
    assert parsed.split.fractions == (0.9, 0.1) and parsed.split.test_reader.header is False
    assert main(["train", "--config", str(job), *cli, "--no-progress", "--epochs", "1", "--run-dir",
                 str(tmp_path / "run")]) == 0
    capsys.readouterr()
    from hetero.data.schema import schema_from_dict
    from hetero.data.split import read_dataset

    schema = schema_from_dict(tomllib.loads(SCHEMA)["schema"], "schema")
    train, valid, test, _ = read_dataset(tmp_path / "train.csv", schema, parsed.reader, parsed.split)
    assert len(test) == 200 and len(train) + len(valid) == 900 and 40 < len(valid) < 150
    for bad, message in ((["--data.split", "[0.8, 0.1, 0.1]", "--data.test_path", "test.csv"], "give two positive"),
                         (["--data.valid_path", "dev.csv"], "valid_path needs test_path")):
        with pytest.raises(ValueError, match=message):
            load_job(["--config", str(job), *bad])
