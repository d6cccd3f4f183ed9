"""One store, one run; ``--overwrite`` removes only what hetero wrote: a second run given a running
run's ``--run-dir`` or ``--ssd-path`` is refused in one line and the first finishes with a checkpoint
that loads; a store another run made is refused, never deleted; ``--overwrite`` in a directory no
hetero run recorded deletes nothing, and in a run's own removes its files."""

import os
import subprocess
import sys
import time

from hetero.checkpoint import load_checkpoint
from hetero.cli import main
from test_dynamic_job import _csv
from test_user_data import IDS_JOB  # (label, user, item: the columns _csv writes)

ARGS = ["--batch-size", "32", "--no-progress", "--embedding-dim", "4", "--hidden", "8", "--patience", "0"]


def _job(tmp_path):
    _csv(tmp_path / "data.csv", n=400)
    (tmp_path / "job.toml").write_text(IDS_JOB.format(data=tmp_path / "data.csv", extra=""))
    return tmp_path / "job.toml"


def test_a_second_run_on_a_running_runs_store_or_directory_is_refused_and_the_first_finishes(tmp_path, capsys):
    job, store = _job(tmp_path), tmp_path / "store"
    ssd = ["--table-storage", "ssd", "--ssd-path", str(store), "--cache-mb", "1"]
    go, waiting = tmp_path / "go", tmp_path / "waiting"
    # the first run stops at its first step until the test says go: it holds its run directory and store meanwhile
    hold = (f"import pathlib, time\nfrom hetero.config import load_job\nfrom hetero.cli.train import run_train\n"
            f"def on_step(trainer):\n    pathlib.Path({str(waiting)!r}).touch()\n"
            f"    while not pathlib.Path({str(go)!r}).exists():\n        time.sleep(0.02)\n"
            f"raise SystemExit(run_train(load_job({[ '--config', str(job), *ARGS, *ssd, '--epochs', '1', '--run-dir', str(tmp_path / 'a')]!r}), on_step))")
    first = subprocess.Popen([sys.executable, "-c", hold], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not waiting.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()
        for name, extra in (("same_store", ["--run-dir", str(tmp_path / "b")]),
                            ("same_run_dir", ["--run-dir", str(tmp_path / "a"), "--overwrite"])):
            capsys.readouterr()
            assert main(["train", "--config", str(job), *ARGS, *ssd, "--epochs", "1", *extra]) == 1, name
            err = capsys.readouterr().err.strip()
            assert "in use by another running hetero job" in err and len(err.splitlines()) == 1, err
            assert first.poll() is None, name  # (still running while refused)
        assert not (tmp_path / "b").exists()
        go.touch()
        assert first.wait(timeout=300) == 0, first.stderr.read()[-2000:]
    finally:
        first.kill()
    load_checkpoint(tmp_path / "a" / "checkpoint.pt")  # its CRC-32s hold
    rows = sorted(p.name for p in store.iterdir())
    capsys.readouterr()  # a store another (finished) run made: refused, untouched
    assert main(["train", "--config", str(job), *ARGS, *ssd, "--epochs", "1", "--run-dir", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err.strip()
    assert f"holds the SSD store of the run in {tmp_path / 'a'}" in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in store.iterdir()) == rows and not (tmp_path / "c").exists()
    assert main(["train", "--config", str(job), *ARGS, *ssd, "--epochs", "1", "--run-dir", str(tmp_path / "a"),
                 "--overwrite"]) == 0  # its own run directory: its store


def test_overwrite_removes_only_what_a_hetero_run_recorded(tmp_path, capsys):
    job = _job(tmp_path)
    run = tmp_path / "mine"  # a user's directory with hetero's names in it, no hetero run
    (run / "tensorboard").mkdir(parents=True)
    (run / "tensorboard" / "events.user").write_text("mine")
    (run / "metrics.json").write_text("{}")
    assert main(["train", "--config", str(job), *ARGS, "--epochs", "1", "--run-dir", str(run), "--overwrite"]) == 0
    assert (run / "tensorboard" / "events.user").read_text() == "mine"
    assert (run / ".hetero-run.json").is_file() and (run / "checkpoint.pt").is_file()
    (run / "tensorboard" / "events.user").unlink()
    (run / "notes.txt").write_text("mine")  # the user's own file beside a hetero run
    before = os.stat(run / "checkpoint.pt").st_mtime_ns
    assert main(["train", "--config", str(job), *ARGS, "--epochs", "1", "--run-dir", str(run), "--overwrite"]) == 0
    assert (run / "notes.txt").read_text() == "mine" and os.stat(run / "checkpoint.pt").st_mtime_ns != before
