"""The command line refuses bad input in one line before anything is read or written: a run
directory holding another run, one that cannot be written, hyper-parameters out of range, job
file values of the wrong type."""

import pytest

from conftest import movielens
from hetero.cli import main

FAST = ["--epochs", "1", "--batch-size", "64", "--no-progress", "--embedding-dim", "4", "--hidden", "8",
        "--max-steps", "2"]


def _err(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hetero: error: "), err
    return err.strip()


def test_a_run_directory_with_another_run_is_refused_unless_resumed_or_overwritten(ml_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *movielens(ml_dir), *FAST, "--run-dir", str(run)]) == 0
    (run / "best.pt").write_bytes(b"an old run's best epoch")
    (run / "notes.txt").write_text("the user's own file")
    before = (run / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    assert main(["train", *movielens(ml_dir), *FAST, "--run-dir", str(run)]) == 1
    assert _err(capsys) == (f"hetero: error: --run-dir {run} holds another run (checkpoint.pt): continue it with "
                            f"--resume, replace it with --overwrite, or give another --run-dir")
    assert (run / "checkpoint.pt").read_bytes() == before
    assert main(["train", *movielens(ml_dir), *FAST, "--run-dir", str(run), "--overwrite", "--seed", "1"]) == 0
    assert not (run / "best.pt").exists() and (run / "notes.txt").exists()  # the old run's files only
    assert (run / "checkpoint.pt").read_bytes() != before
    assert main(["train", *movielens(ml_dir), *FAST, "--run-dir", str(run), "--overwrite", "--resume"]) == 1
    assert "give one" in _err(capsys)


@pytest.mark.parametrize("where", ["a_file", "under_a_file"])
def test_an_unwritable_run_directory_is_named_before_the_data_is_read(ml_dir, tmp_path, capsys, where):
    (tmp_path / "file").write_text("x")
    run = tmp_path / "file" if where == "a_file" else tmp_path / "file" / "run"
    assert main(["train", *movielens(ml_dir), *FAST, "--run-dir", str(run)]) == 1
    err = _err(capsys)
    assert f"--run-dir {run}" in err and ("is a file: give a directory" in err or "cannot be created" in err)


@pytest.mark.parametrize("flag,value,message", [
    ("--wide-lr", "0", "optimizer.wide_lr (--wide-lr) = 0.0: give a value > 0.0"),
    ("--dense-lr", "0", "optimizer.dense_lr (--dense-lr) = 0.0: give a value > 0.0"),
    ("--deep-lr", "-0.1", "optimizer.deep_lr (--deep-lr) = -0.1: give a value > 0.0"),
    ("--ftrl-l2", "-1", "optimizer.ftrl_l2 (--ftrl-l2) = -1.0: give a value >= 0.0"),
    ("--dropout", "1", "model.dropout (--dropout) = 1.0: give a value in [0.0, 1.0)"),
    ("--batch-size", "0", "training.batch_size (--batch-size) = 0: give a value >= 1"),
])
def test_hyper_parameters_out_of_range_are_named_at_parse_time(ml_dir, tmp_path, capsys, flag, value, message):
    assert main(["train", *movielens(ml_dir), *FAST, flag, value, "--run-dir", str(tmp_path / "run")]) == 1
    assert _err(capsys) == f"hetero: error: {message}"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("line,section,message", [
    ("split = 0.8", "data", "[data]: split = 0.8 is a number; give a list of 3 numbers or a list of 2 numbers, e.g. split = [0.8, 0.1, 0.1]"),
    ("positive = 1", "label", "[schema] label: positive = 1 is an integer; give a list of strings, e.g. positive = "),
    ('hash_buckets = "1000"', "cat", "[schema] categorical[0]: hash_buckets = '1000' is a string; give an integer, "
                                     "e.g. hash_buckets = 1000"),
    ("separator = 124", "cat", "[schema] categorical[0]: separator = 124 is an integer; give a string, e.g. "
                               "separator = \"text\""),
    ('threshold = "4"', "label", "[schema] label: threshold = '4' is a string; give a number, e.g. threshold = 0.5"),
    ('delimiter = 9', "data", "[data]: delimiter = 9 is an integer; give a string, e.g. delimiter = \"text\""),
])
def test_job_file_values_of_the_wrong_type_name_key_type_and_example(tmp_path, capsys, line, section, message):
    data = line if section == "data" else ""
    label = f'{{ column = "y", {line} }}' if section == "label" else '"y"'
    cat = line if section == "cat" else ""
    job = tmp_path / "job.toml"
    job.write_text(f'[data]\npath = "x.csv"\n{data}\n[schema]\nlabel = {label}\n[[schema.categorical]]\n'
                   f'column = "c"\n{cat}\n')
    assert main(["train", "--config", str(job), "--run-dir", str(tmp_path / "run")]) == 1
    assert f"hetero: error: {job} {message}" in _err(capsys)


def test_every_key_says_what_it_means_and_help_shows_every_key(capsys):
    from hetero.config.job import SECTIONS, Data, JobConfig, keys

    for cls in (JobConfig, Data, *SECTIONS.values()):
        for name, k in keys(cls).items():
            assert k.help, f"{cls.__name__}.{name} has no docstring (its meaning in --help and the reference)"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for section, cls in (("data", Data), *SECTIONS.items()):
        for name in keys(cls):
            assert f"--{section}.{name}" in text, f"hetero train --help does not show --{section}.{name}"


def test_the_job_file_reference_is_generated_from_the_code_and_current():
    from pathlib import Path

    from hetero.cli.reference import reference

    doc = Path(__file__).resolve().parents[1] / "docs" / "job-file.md"
    assert doc.read_text() == reference(), "docs/job-file.md is stale: python tools/docs.py"
    for key in ("`null_values`", "`negative`", "`fill`", "`hash_buckets`", "`dense_lr`", "`overwrite`", "`split`"):
        assert key in doc.read_text()


def test_hetero_help_answers_without_importing_torch():
    """``hetero --help`` took 3.5-4 s (torch's import); the launcher answers alone."""
    import subprocess
    import sys

    code = "import sys, hetero_cli; code = hetero_cli.main(['--help']); assert 'torch' not in sys.modules; sys.exit(code)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: hetero {train,"), done.stderr
