"""The Wide & Deep main job pipelined (``hetero train --pp 2``): host tables in stage 0, their
sparse gradients on the host; equal to the unpipelined job on the same batches, and its
checkpoints move between pipeline degrees."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import criteo_job, criteo_lines, hetero_on_ranks, movielens

from hetero.cli import main

ARGS = ["train", "--epochs", "2", "--batch-size", "32", "--no-progress", "--embedding-dim", "4", "--hidden", "16,8",
        "--dropout", "0"]


@pytest.fixture
def criteo(tmp_path):
    path = tmp_path / "criteo.tsv"
    path.write_text(criteo_lines(150))  # 120 training samples: 3 batches of 32 and a short one of 24 per epoch
    return path


def _data(path):
    """The Criteo job file (64 rows per table) on ``path``."""
    return ["--config", str(criteo_job(path.parent)), "--data-path", str(path)]


def _on_ranks(data, run_dir, *extra, args=ARGS, ok=True):
    run = hetero_on_ranks(Path(run_dir).parent, 2, [*args, *data, "--run-dir", str(run_dir), "--pp", "2", *extra])
    assert (run.returncode == 0) == ok, run.stderr[-3000:]
    return run


def _single(data, run_dir, *extra):
    assert main([*ARGS, *_data(data), "--run-dir", str(run_dir), *extra]) == 0


def _assert_same_run(got, want, name):
    a = torch.load(got / "checkpoint.pt", weights_only=False, map_location="cpu")  # (the one-process run: maybe a GPU's)
    b = torch.load(want / "checkpoint.pt", weights_only=False, map_location="cpu")
    assert a["position"] == b["position"]
    assert a["model"].keys() == b["model"].keys()
    for k, v in b["model"].items():  # host tables and the MLP
        torch.testing.assert_close(a["model"][k], v, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {k}: {m}")
    for opt, saved in b["sparse_optimizers"].items():  # LazyAdam moments and FTRL accumulators, row by row
        for table, tensors in saved["state"].items():
            for s, v in tensors.items():
                torch.testing.assert_close(a["sparse_optimizers"][opt]["state"][table][s], v, rtol=0, atol=1e-5,
                                           msg=lambda m: f"{name}: {opt} {table} {s}: {m}")
    dense_a, dense_b = a["dense_optimizer"], b["dense_optimizer"]
    assert [len(g["params"]) for g in dense_a["param_groups"]] == [len(g["params"]) for g in dense_b["param_groups"]]
    for i, st in dense_b["state"].items():
        for s, v in st.items():
            torch.testing.assert_close(dense_a["state"][i][s], v, rtol=0, atol=1e-5, msg=lambda m: f"{name}: adam {i} {s}")
    torch.testing.assert_close(a["losses"], b["losses"], rtol=0, atol=1e-5)  # the batch losses, reported
    metrics = [json.loads((d / "metrics.json").read_text()) for d in (got, want)]
    assert metrics[0]["test_auc"] == pytest.approx(metrics[1]["test_auc"], abs=1e-6)  # evaluated through the stages


@pytest.mark.parametrize("schedule,micro", [("1f1b", "4"), ("gpipe", "2")])
def test_the_pipelined_main_job_equals_the_unpipelined_one(tmp_path, criteo, schedule, micro, cpu_ranks):
    _single(criteo, tmp_path / "one")
    run = _on_ranks(_data(criteo), tmp_path / "pp", "--schedule", schedule, "--micro-batches", micro)
    assert "stage 0 (rank 0): wide, deep, wide_dense, mlp.0, mlp.1; parameters" in run.stderr  # tables in stage 0
    _assert_same_run(tmp_path / "pp", tmp_path / "one", schedule)


def test_a_pipelined_checkpoint_resumes_without_the_pipeline_and_back(tmp_path, criteo, cpu_ranks):
    _single(criteo, tmp_path / "one")
    _on_ranks(_data(criteo), tmp_path / "pp", "--max-steps", "3")  # mid-epoch 1
    shutil.copytree(tmp_path / "pp", tmp_path / "pp_then_one")
    _single(criteo, tmp_path / "pp_then_one", "--resume")
    _assert_same_run(tmp_path / "pp_then_one", tmp_path / "one", "pp 2 -> 1")
    _single(criteo, tmp_path / "one_then_pp", "--max-steps", "6")  # mid-epoch 2, after the short batch
    _on_ranks(_data(criteo), tmp_path / "one_then_pp", "--resume")
    _assert_same_run(tmp_path / "one_then_pp", tmp_path / "one", "pp 1 -> 2")


def test_bad_pipeline_flags_are_refused_naming_the_fix(tmp_path, criteo, capsys, ml_dir):
    base = [*ARGS, *_data(criteo), "--run-dir", str(tmp_path / "r")]
    assert main([*base, "--pp", "2"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hetero: error: parallelism.pp = 2 (--pp) runs every rank of hetero train in it: start torchrun --nproc-per-node "
        "2 (this job has 1 ranks); pp x dp is hetero.apply's (a plan over a pp x dp x tp mesh), not yet hetero train's")
    assert main([*base, "--pp", "2", "--zero", "1", "--prefetch"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hetero: error: parallelism.pp (--pp) with training.prefetch (--prefetch), parallelism.zero (--zero): the "
        "pipeline runs alone (replicated tables, integrated checkpoints); drop one")
    # MovieLens' genres are bags: rows cannot cut them into micro-batches (yet)
    run = _on_ranks(movielens(ml_dir), tmp_path / "ml", args=["train", "--epochs", "1", "--no-progress"], ok=False)
    assert ("hetero: error: a pipeline cuts each batch into micro-batches by rows, which cannot cut the multi-hot "
            "features ['age_group_x_genres', 'gender_x_genres', 'genres', 'user_x_genres'] (bags) yet: train them "
            "without a pipeline") in run.stderr
