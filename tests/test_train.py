"""Trainer and CLI: exact resume, NaN guard, checkpoint validation, run artefacts."""

import json

import pytest
import torch

from hetero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from hetero.cli import main
from hetero.data import BatchConfig, Batches, FeatureRole
from hetero.embedding import dense_parameters, host_tables
from hetero.models.wide_deep import FeatureSlot, WideDeep, WideDeepConfig
from hetero.optim import FTRL, LazyAdam
from hetero.train import TrainConfig, Trainer

from conftest import criteo_job, criteo_lines, make_dataset, movielens


def _cli(ml_dir, run_dir, *extra):
    return main(["train", *movielens(ml_dir), "--run-dir", str(run_dir), "--epochs", "2",
                 "--batch-size", "64", "--no-progress", "--embedding-dim", "8", "--hidden", "16,8", *extra])


def test_cli_run_writes_metrics_plot_and_prints_json_last(ml_dir, tmp_path, capsys):
    assert _cli(ml_dir, tmp_path / "run") == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    metrics = json.loads(last)
    assert set(metrics) >= {"test_auc", "test_logloss", "samples_per_s", "wall_time_s", "checkpoint"}
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["test_auc"] == metrics["test_auc"]
    assert (tmp_path / "run" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert load_checkpoint(metrics["checkpoint"])["position"]["epoch"] == 2


def test_resume_from_mid_epoch_checkpoint_is_bitwise_identical(ml_dir, tmp_path):
    # 960 training samples / 64 = 15 batches per epoch; stop at step 7, in the middle of epoch 1.
    assert _cli(ml_dir, tmp_path / "full") == 0
    assert _cli(ml_dir, tmp_path / "cut", "--max-steps", "7") == 0
    ckpt = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert ckpt["position"] == {"epoch": 0, "batch": 7, "global_step": 7}
    assert _cli(ml_dir, tmp_path / "cut", "--resume") == 0
    full = (tmp_path / "full" / "losses.csv").read_text()
    assert full.count("\n") == 31  # header + 30 steps
    assert (tmp_path / "cut" / "losses.csv").read_text() == full  # repr() of every float: bitwise
    a = load_checkpoint(tmp_path / "full" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert json.loads((tmp_path / "cut" / "metrics.json").read_text())["test_auc"] == \
        json.loads((tmp_path / "full" / "metrics.json").read_text())["test_auc"]


def test_resume_without_checkpoint_is_a_clear_error(ml_dir, tmp_path, capsys):
    assert _cli(ml_dir, tmp_path / "nothing", "--resume") == 1
    assert f"hetero: error: no checkpoint at {tmp_path / 'nothing' / 'checkpoint.pt'}" in capsys.readouterr().err


def test_checkpoint_from_other_model_config_names_parameter_and_shapes(ml_dir, tmp_path, capsys):
    assert _cli(ml_dir, tmp_path / "run", "--max-steps", "2") == 0
    assert _cli(ml_dir, tmp_path / "run", "--resume", "--embedding-dim", "4") == 1
    err = capsys.readouterr().err
    assert (f"checkpoint {tmp_path / 'run' / 'checkpoint.pt'} was saved from another model config: parameter "
            "'deep.tables.deep_user.weight' has shape (41, 8) in the checkpoint and (41, 4) in this model") in err


def test_truncated_checkpoint_is_reported_and_atomic_save_keeps_the_old_one(tmp_path):
    path = save_checkpoint({"x": torch.arange(1000)}, tmp_path / "c.pt")
    torn = tmp_path / "torn.pt"
    torn.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="is unreadable \\(truncated or not a hetero checkpoint\\)"):
        load_checkpoint(torn)

    class Boom:
        def __reduce__(self):
            raise RuntimeError("crash while writing")

    with pytest.raises(RuntimeError, match="crash while writing"):
        save_checkpoint({"x": Boom()}, path)
    assert torch.equal(load_checkpoint(path)["x"], torch.arange(1000))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "torn.pt"]  # no temp file left behind


def _trainer(data, run_dir, held_out=None, **config):
    torch.manual_seed(0)
    slots = [FeatureSlot(f.name, f.vocab_size, f.multi_hot, wide=True, deep=f.role is not FeatureRole.WIDE) for f in data.specs]
    model = WideDeep(slots, data.num_dense, WideDeepConfig(embedding_dim=4, hidden=(8,), dropout=0.2))
    tables = host_tables(model)
    sparse = {"wide": FTRL({k: t for k, t in tables.items() if k.startswith("wide.")}),
              "deep": LazyAdam({k: t for k, t in tables.items() if k.startswith("deep.")})}
    dense = torch.optim.Adam(dense_parameters(model), lr=1e-2)
    batches = Batches(data, BatchConfig(batch_size=50, shuffle=False))
    held_out = data if held_out is None else held_out
    return Trainer(model, dense, sparse, batches, held_out, held_out, TrainConfig(progress=False, **config), run_dir)


def _assert_states_equal(got, want, where="state"):
    if isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys differ"
        for k in want:
            _assert_states_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


def test_nan_loss_stops_before_the_update_and_keeps_last_good_checkpoint(tmp_path):
    data = make_dataset(600)
    data.dense[260, 0] = float("nan")  # in batch 6 (samples 250..299), i.e. step 6
    trainer = _trainer(data, tmp_path / "nan", checkpoint_every=2)
    with pytest.raises(FloatingPointError) as err:
        trainer.fit()
    assert str(err.value) == (f"loss is nan at epoch 0, batch 5 (step 6); training stopped before applying this step; "
                              f"the last checkpoint {tmp_path / 'nan' / 'checkpoint.pt'} is intact: lower the learning "
                              f"rates or check the input, then --resume")
    saved = load_checkpoint(tmp_path / "nan" / "checkpoint.pt")
    assert saved["position"]["global_step"] == 4

    clean = make_dataset(600)
    reference = _trainer(clean, tmp_path / "ref", max_steps=4)
    reference.fit()
    expected = load_checkpoint(tmp_path / "ref" / "checkpoint.pt")
    for k, v in expected["model"].items():
        assert torch.equal(v, saved["model"][k]), k
    for name, opt in expected["sparse_optimizers"].items():
        for table, state in opt["state"].items():
            for s, t in state.items():
                assert torch.equal(t, saved["sparse_optimizers"][name]["state"][table][s])
    # In memory: the model and every optimizer as after step 5, nothing of step 6 applied.
    after_5 = _trainer(make_dataset(600), tmp_path / "ref5", max_steps=5)
    after_5.fit()
    got, want = trainer.state_dict(), after_5.state_dict()
    for key in ("model", "dense_optimizer", "sparse_optimizers"):
        _assert_states_equal(got[key], want[key], key)


def test_nan_loss_before_any_checkpoint_says_there_is_none(tmp_path):
    data = make_dataset(600)
    data.dense[260, 0] = float("nan")
    with pytest.raises(FloatingPointError) as err:
        _trainer(data, tmp_path / "nan").fit()
    assert str(err.value).endswith("training stopped before applying this step; no checkpoint was written yet: lower "
                                   "the learning rates or check the input and start again")
    assert not (tmp_path / "nan").exists()


def test_training_learns_the_synthetic_signal(tmp_path):
    train, held_out = make_dataset(2400).split((2000 / 2400, 400 / 2400), seed=1)  # scored on samples it never saw
    trainer = _trainer(train, tmp_path / "learn", held_out=held_out, epochs=8)
    metrics = trainer.fit()
    assert metrics["test_auc"] > 0.75
    assert trainer.losses[-1] < trainer.losses[0]


def test_prefetch_leaves_the_loss_trajectory_bitwise_unchanged(ml_dir, tmp_path):
    assert _cli(ml_dir, tmp_path / "plain", "--epochs", "1") == 0
    assert _cli(ml_dir, tmp_path / "pre", "--epochs", "1", "--prefetch", "--threads", "1") == 0
    assert (tmp_path / "pre" / "losses.csv").read_text() == (tmp_path / "plain" / "losses.csv").read_text()


def test_cli_errors_of_hetero_are_one_line_and_others_keep_their_traceback(ml_dir, tmp_path, capsys, monkeypatch):
    # hetero's own error (bad input): one line naming the fix
    assert _cli(ml_dir, tmp_path / "a", "--resume") == 1
    err = capsys.readouterr().err
    assert "hetero: error: no checkpoint at" in err and "Traceback" not in err
    # an error from below hetero (here a stand-in for a CUDA failure inside torch): the traceback
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.nn.functional, "binary_cross_entropy_with_logits", broken)
    assert _cli(ml_dir, tmp_path / "b") == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in broken" in err
    assert err.rstrip().endswith("RuntimeError: CUDA error: an illegal memory access was encountered")
    # a failing torch builtin called from hetero's own line (no Python frame of its own): the traceback too
    monkeypatch.setattr(torch.nn.functional, "binary_cross_entropy_with_logits", torch.cat)
    assert _cli(ml_dir, tmp_path / "c") == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "trainer.py" in err


@pytest.mark.parametrize("rows", [0, 5])
def test_an_empty_or_tiny_file_is_a_clear_error_before_the_model_is_built(tmp_path, capsys, rows):
    path = tmp_path / "small.tsv"
    path.write_text(criteo_lines(rows))
    assert main(["train", "--config", str(criteo_job(tmp_path)), "--data-path", str(path), "--run-dir",
                 str(tmp_path / "run"), "--no-progress"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hetero: error: {path} has {rows} samples: its train/validation/test split leaves a part empty; use a larger "
        f"file")


def test_a_single_class_evaluation_writes_valid_json_with_null(tmp_path, capsys):
    import numpy as np

    path = tmp_path / "negatives.tsv"
    # two positives, both in the training split (the split's draw per row, seed 0): evaluation sees one class
    train = [i for i, u in enumerate(np.random.default_rng(0).random(60)) if u < 0.8][:2]
    lines = criteo_lines(60, label=0).splitlines()
    for i in train:
        lines[i] = "1" + lines[i][1:]
    path.write_text("\n".join(lines) + "\n")
    assert main(["train", "--config", str(criteo_job(tmp_path)), "--data-path", str(path), "--run-dir",
                 str(tmp_path / "run"), "--no-progress", "--epochs", "1", "--batch-size", "16"]) == 0

    def no_nan(token):
        raise AssertionError(f"{token} in JSON")

    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1], parse_constant=no_nan)
    assert last["test_auc"] is None and last["test_logloss"] >= 0
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text(), parse_constant=no_nan)
    assert saved["history"]["valid_auc"] == [None]


@pytest.mark.parametrize("flag,saved,other", [("--seed", "0", "1"), ("--batch-size", "64", "32")])
def test_resume_refuses_a_change_that_moves_the_data_position(ml_dir, tmp_path, capsys, flag, saved, other):
    # Another seed draws another split (old test samples would train); another batch size would
    # reinterpret the saved batch index. Refused, naming the flag; nothing changes.
    run = tmp_path / "run"
    assert _cli(ml_dir, run, "--max-steps", "7") == 0
    before = (run / "checkpoint.pt").read_bytes()
    assert _cli(ml_dir, run, "--resume", flag, other) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"hetero: error: checkpoint {run / 'checkpoint.pt'} was saved with ")
    assert f"this run has {other} ({flag})" in err and err.endswith(f"resume with {flag} {saved}")
    assert (run / "checkpoint.pt").read_bytes() == before


def test_resume_applies_new_learning_rates_and_logs_them(ml_dir, tmp_path, caplog):
    import logging

    run = tmp_path / "run"
    assert _cli(ml_dir, run, "--max-steps", "7") == 0
    with caplog.at_level(logging.INFO, logger="hetero"):
        assert _cli(ml_dir, run, "--resume", "--deep-lr", "0.0001", "--dense-lr", "0.0002") == 0
    msgs = [r.getMessage() for r in caplog.records if "resume:" in r.getMessage()]
    assert any(m.startswith("hetero: resume: sparse optimizer 'deep' lr = 0.0001 (this run's; the checkpoint had ")
               for m in msgs), msgs
    assert any(m.startswith("hetero: resume: dense_optimizer group 0 lr = 0.0002") for m in msgs), msgs
    saved = load_checkpoint(run / "checkpoint.pt")
    assert saved["sparse_optimizers"]["deep"]["config"]["lr"] == 0.0001
    assert saved["dense_optimizer"]["param_groups"][0]["lr"] == 0.0002


def test_a_failed_resume_changes_nothing_in_the_trainer(tmp_path):
    # The sparse optimizers are checked before the model and the dense optimizer are loaded.
    data = make_dataset(300)
    first = _trainer(data, tmp_path / "a", max_steps=3)
    first.fit()
    other = _trainer(data, tmp_path / "a")
    from hetero.optim import Adagrad

    tables = host_tables(other.model)
    adagrad = Adagrad({k: t for k, t in tables.items() if k.startswith("deep.")})
    other = Trainer(other.model, other.optimizers.dense, {"wide": other.optimizers.sparse["wide"], "deep": adagrad},
                    other.train, data, data, other.config, tmp_path / "a")
    model_before = {k: v.clone() for k, v in other.model.state_dict().items()}
    dense_before = {k: v for k, v in other.optimizers.dense.state_dict().items()}
    with pytest.raises(CheckpointError, match="sparse optimizer state is for LazyAdam, not Adagrad"):
        other.resume()
    for k, v in other.model.state_dict().items():
        assert torch.equal(v, model_before[k]), k
    assert other.optimizers.dense.state_dict() == dense_before and other.global_step == 0


def _ddp_leaves_host_adamw_out(run_dir):
    from hetero.optim import HostAdamW

    data = make_dataset()
    torch.manual_seed(0)
    slots = [FeatureSlot(f.name, f.vocab_size, f.multi_hot, wide=f.role is not FeatureRole.DEEP,
                         deep=f.role is not FeatureRole.WIDE) for f in data.specs]
    model = WideDeep(slots, data.dense.shape[1], WideDeepConfig(embedding_dim=4, hidden=(8,), dropout=0.0))
    tables = host_tables(model)
    sparse = {"wide": FTRL({k: v for k, v in tables.items() if k.startswith("wide.")}),
              "deep": LazyAdam({k: v for k, v in tables.items() if k.startswith("deep.")})}
    mlp = [(n, p) for n, p in model.named_parameters() if n.startswith("mlp.")]
    dense = HostAdamW(mlp, lr=1e-3)  # the --plan path's offloaded state: it averages these gradients itself
    batches = Batches(data, BatchConfig(batch_size=64, shuffle=True, seed=0, rank=torch.distributed.get_rank(),
                                        world_size=2))
    trainer = Trainer(model, dense, sparse, batches, data, data, TrainConfig(progress=False), run_dir)
    return sorted(trainer.net.parameters_to_ignore), [n for n, _ in mlp]


def test_ddp_leaves_out_what_an_offloaded_optimizer_averages_itself(tmp_path):
    from conftest import run_ranks

    ignored, offloaded = run_ranks(tmp_path, 2, _ddp_leaves_host_adamw_out, str(tmp_path / "run"))
    assert set(offloaded) <= set(ignored)  # averaged once, by HostAdamW (hetero.apply's rule), not also by DDP
    assert "wide_dense.weight" not in ignored  # the rest stays DDP's
