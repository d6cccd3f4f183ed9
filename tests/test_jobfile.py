"""``hetero train --config job.toml``: a user's CSV trained end to end with no Python; the file's
keys checked, its flags overridden by the command line's."""

import json
import math
import random

import numpy as np
import pytest

from hetero.cli import main

JOB = """
[data]
path = "{path}"
split = [0.7, 0.15, 0.15]

[schema]
label = {{ column = "clicked", positive = ["yes", "1"] }}
drop = ["note"]

[[schema.categorical]]
column = "city"

[[schema.categorical]]
column = "tags"
separator = "|"
min_count = 2

[[schema.dense]]
column = "age"
transform = "standardize"

[[schema.crosses]]
columns = ["city", "tags"]
hash_buckets = 64

[train]
epochs = 4
batch_size = 32
hidden = [16, 8]
embedding_dim = 4
dropout = 0.0
deep_lr = 0.05
no_progress = true
"""


def _clicks(path, n=1200, seed=0):
    """Clicks that depend on the city and on age (a model must learn both)."""
    rng = random.Random(seed)
    cities = ["Zürich", "東京", "New York, NY", "Paris", "Lagos", "Lima"]
    lines = ["clicked,city,tags,age,note"]
    for i in range(n):
        city, age = rng.choice(cities), rng.randint(18, 70)
        tags = "|".join(rng.sample("abcde", rng.randint(0, 3)))
        p = 1 / (1 + math.exp(-(2 * (1 if cities.index(city) < 3 else -1) + (age - 44) / 8)))
        label = rng.choice(["yes", "1"]) if rng.random() < p else "no"
        lines.append(f'{label},"{city}",{tags},{age if rng.random() > 0.05 else ""},n{i}')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_a_users_csv_trains_from_a_config_file_and_flags_override_it(tmp_path, capsys):
    data = tmp_path / "clicks.csv"
    _clicks(data)
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(path=data))
    assert main(["train", "--config", str(job), "--run-dir", str(tmp_path / "run")]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["test_auc"] > 0.75  # learned the city and age signal (0.83 measured; chance is 0.5)
    # the split's rows by its definition (a uniform draw per row, seed 0); batches of 32, 4 epochs (the file's)
    batches = -(-int((np.random.default_rng(0).random(1200) < 0.7).sum()) // 32)
    assert metrics["steps"] == 4 * batches
    assert main(["train", "--config", str(job), "--epochs", "1", "--run-dir", str(tmp_path / "one")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == batches  # the flag wins


@pytest.mark.parametrize("change,message", [
    ('separator = "|"', 'separater = "|"', ),
    ("[train]", "[trian]"),
    ("batch_size = 32", "batch_sise = 32"),
    ('transform = "standardize"', 'transform = "zscore"'),
    ("no_progress = true", "no_progress = 1"),
    ('column = "age"', 'column = "height"'),
], ids=["schema-key", "section", "flag", "enum", "switch", "missing-column"])
def test_a_bad_config_names_where_and_the_fix_and_writes_nothing(tmp_path, capsys, change, message):
    data = tmp_path / "clicks.csv"
    _clicks(data, n=50)
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(path=data).replace(change, message, 1))
    assert main(["train", "--config", str(job), "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    want = {
        "separater": "[schema] categorical[1]: no key 'separater'; did you mean 'separator'? valid keys are",
        "[trian]": ": no key 'trian'; did you mean 'train'? valid keys are ['data', 'schema', 'train', 'model', 'tables', 'optimizer', "
     "'training', 'checkpoint', 'parallelism', 'parameter_server', 'planner', 'logging']",
        "batch_sise": "[train]: no key 'batch_sise'; did you mean 'batch_size'? valid keys are",
        "zscore": "[schema] dense[0]: transform = 'zscore' does not exist; valid values are ['none', 'log1p', "
                  "'standardize']",
        "no_progress = 1": "[train]: no_progress = 1: give true or false",
        "height": "clicks.csv has no column 'height' that the schema names; its columns are ['clicked', 'city', "
                  "'tags', 'age', 'note']",
    }
    key = next(k for k in want if k in message)
    assert err.startswith("hetero: error: ") and want[key] in err, err
    assert not (tmp_path / "run").exists()  # nothing written


def test_early_stopping_scores_test_with_the_best_epoch(tmp_path, capsys):
    data = tmp_path / "clicks.csv"
    _clicks(data, n=600)
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(path=data).replace("deep_lr = 0.05", "deep_lr = 0.5\ndense_lr = 0.05"))  # overfits
    assert main(["train", "--config", str(job), "--epochs", "25", "--patience", "2", "--run-dir", str(tmp_path / "es")]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    history = json.loads((tmp_path / "es" / "metrics.json").read_text())["history"]["valid_auc"]
    best = got["best_epoch"]
    assert got["stopped_early"] and len(history) == best + 2 < 25  # two epochs without a better AUC, then stop
    assert history[best - 1] == max(history) and (tmp_path / "es" / "best.pt").is_file()
    # the same run trained for exactly the best epoch's count: its test AUC is the early-stopped run's
    assert main(["train", "--config", str(job), "--epochs", str(best), "--run-dir", str(tmp_path / "ref")]) == 0
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["test_auc"] == pytest.approx(want["test_auc"], abs=1e-9)
    # a stopped run stays stopped on --resume
    assert main(["train", "--config", str(job), "--epochs", "25", "--patience", "2", "--resume",
                 "--run-dir", str(tmp_path / "es")]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["steps"] == got["steps"] and again["test_auc"] == pytest.approx(got["test_auc"], abs=1e-9)


def test_a_default_run_selects_on_validation_writes_best_pt_and_names_the_epoch_scored(tmp_path, capsys, caplog):
    """No flag: the best epoch (validation AUC) is kept, training stops 2 epochs after it, the
    test split is scored by it (and said so, not as a resume), and README's predict on best.pt works."""
    import logging

    data = tmp_path / "clicks.csv"
    _clicks(data, n=600)
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(path=data).replace("deep_lr = 0.05", "deep_lr = 0.5\ndense_lr = 0.05"))  # overfits
    with caplog.at_level(logging.INFO, logger="hetero"):
        assert main(["train", "--config", str(job), "--epochs", "25", "--run-dir", str(tmp_path / "d")]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    history = json.loads((tmp_path / "d" / "metrics.json").read_text())["history"]["valid_auc"]
    assert got["stopped_early"] and got["test_epoch"] == got["best_epoch"] < got["epochs"] < 25
    assert history[got["best_epoch"] - 1] == max(history)
    said = [r.getMessage() for r in caplog.records]
    assert not any("resumed from" in m for m in said), said
    assert any(f"scored by the best epoch's model (epoch {got['best_epoch']} of {got['epochs']}" in m for m in said)
    assert main(["predict", "--checkpoint", str(tmp_path / "d" / "best.pt"), "--data", str(data),
                 "--out", str(tmp_path / "s.csv")]) == 0


def test_hetero_plan_reads_a_job_file_that_trains_with_a_plan(tmp_path):
    from hetero.config import load_job

    job = tmp_path / "job.toml"
    job.write_text(JOB.format(path=tmp_path / "clicks.csv").replace("[train]\n", '[train]\nplan = "auto"\n'))
    job = load_job(["--config", str(job), "--out", str(tmp_path / "p.json")], "hetero plan")
    assert job.training.epochs == 4 and job.training.batch_size == 32  # the rest of [train] is the job it plans
    assert job.planner.plan == "auto" and job.planner.out == tmp_path / "p.json"


def test_an_epoch_is_never_lost_to_a_failed_evaluation(tmp_path, capsys, monkeypatch):
    """An evaluation that raises after an epoch trained: the epoch's checkpoint is written first,
    and a resume continues after it (it does not train the epoch again)."""
    import torch

    from hetero.train.trainer import Trainer

    data = tmp_path / "clicks.csv"
    _clicks(data, n=300)
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(path=data))
    evaluate = Trainer.evaluate

    def failing(self, data):
        raise OSError("the evaluation files went away")

    monkeypatch.setattr(Trainer, "evaluate", failing)
    args = ["train", "--config", str(job), "--epochs", "2", "--patience", "0", "--run-dir", str(tmp_path / "run")]
    assert main(args) == 1
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", map_location="cpu")
    assert saved["position"]["epoch"] == 1 and saved["position"]["batch"] == 0 and saved["position"]["global_step"] > 0
    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    assert main([*args, "--resume"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["epochs"] == 2 and got["steps"] == 2 * saved["position"]["global_step"]


def test_curves_png_shows_whole_epochs_both_log_losses_and_the_chosen_epoch(tmp_path, monkeypatch):
    import matplotlib.figure

    from hetero.train.report import plot_curves

    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: drawn.append(fig))
    history = {"epoch": [1, 2, 3], "valid_auc": [0.70, 0.74, 0.72], "valid_logloss": [0.60, 0.55, 0.58],
               "steps": [10, 20, 30]}
    plot_curves([0.7 - 0.01 * i for i in range(30)], history, 2, tmp_path / "curves.png")
    loss, auc = drawn[0].axes
    labels = {line.get_label(): line for line in loss.get_lines()}
    assert list(labels["validation"].get_xdata()) == [1.0, 2.0, 3.0]  # at each epoch's end, on the epoch axis
    assert list(labels["validation"].get_ydata()) == [0.60, 0.55, 0.58]
    assert labels["training, mean of 10"].get_xdata()[-1] == 3.0  # the steps on the same axis of epochs
    for ax in (loss, auc):
        marks = [line for line in ax.get_lines() if line.get_label() == "chosen: epoch 2"]
        assert len(marks) == 1 and list(marks[0].get_xdata()) == [2, 2]
        assert all(float(t).is_integer() for t in ax.get_xticks())  # whole-epoch ticks
