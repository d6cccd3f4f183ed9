"""One typed job configuration: defaults < job file < command line, the old flags as aliases of
the section keys, the resolved job written with every checkpoint as ``RUN_DIR/config.toml``
(training again from it gives the same run), and TensorBoard scalars beside the metrics."""

import json
import os

import pytest

from hetero.cli import main
from hetero.config import JobConfig, job_to_toml, load_job, read_job_file
from hetero.config.job import ModelKind, TableSharding
from hetero.optim import SparseOptimizerKind
from test_jobfile import JOB, _clicks


def _job(tmp_path, extra=""):
    data = tmp_path / "clicks.csv"
    _clicks(data, n=600)
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(path=data) + extra)
    return job


def _metrics(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_run_trained_again_from_its_config_toml_gives_identical_metrics(tmp_path, capsys):
    job = _job(tmp_path)
    first = tmp_path / "first"
    assert main(["train", "--config", str(job), "--epochs", "2", "--wide-lr", "0.1", "--run-dir", str(first)]) == 0
    want = _metrics(capsys)
    recorded = (first / "config.toml").read_text()
    assert 'wide_lr = 0.1' in recorded and "epochs = 2" in recorded  # the command line's values, resolved
    # from another directory: the recorded data paths are absolute
    os.chdir(tmp_path / "first")
    second = tmp_path / "second"
    assert main(["train", "--config", str(first / "config.toml"), "--run-dir", str(second)]) == 0
    got = _metrics(capsys)
    for key in ("test_auc", "test_logloss", "steps", "epochs", "best_epoch"):
        assert got[key] == want[key], key
    # the second run's own record differs in its run directory alone
    assert (second / "config.toml").read_text() == recorded.replace(str(first), str(second))


def test_defaults_then_the_job_file_then_the_command_line(tmp_path):
    job = _job(tmp_path, '\n[parallelism]\ntable_sharding = "row"\n')
    assert JobConfig().training.batch_size == 256  # the default
    from_file = load_job(["--config", str(job)])
    assert from_file.training.batch_size == 32 and from_file.model.hidden == (16, 8)  # [train] old names
    assert from_file.parallelism.table_sharding is TableSharding.ROW  # a section of its own
    for argv in (["--batch-size", "8"], ["--training.batch_size", "8"], ["--training.batch-size", "8"]):
        assert load_job(["--config", str(job), *argv]).training.batch_size == 8, argv
    over = load_job(["--config", str(job), "--hidden", "4,2", "--deep-optimizer", "adagrad", "--model", "dlrm",
                     "--no-progress", "--resume"])
    assert over.model.hidden == (4, 2) and over.optimizer.deep is SparseOptimizerKind.ADAGRAD
    assert over.model.name is ModelKind.DLRM and over.logging.progress is False and over.checkpoint.resume.value == "yes"


def test_the_written_toml_reads_back_as_the_same_job(tmp_path):
    job = load_job(["--config", str(_job(tmp_path)), "--zero", "1", "--device-memory", "2GiB"])
    path = tmp_path / "again.toml"
    path.write_text(job_to_toml(job))
    again = read_job_file(path)
    for section in ("data", "model", "optimizer", "training", "parallelism", "parameter_server", "planner", "logging"):
        assert getattr(again, section) == getattr(job, section), section
    assert again.schema == job.schema and again.planner.device_memory == 2**31


def test_a_key_set_in_its_section_and_in_train_is_refused(tmp_path, capsys):
    job = _job(tmp_path, "\n[training]\nbatch_size = 64\n")
    assert main(["train", "--config", str(job), "--run-dir", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err == (f"hetero: error: {job}: batch_size is set in [training] and as batch_size in "
                                       f"[train]: keep one\n")
    assert not (tmp_path / "run").exists()


def test_tensorboard_scalars_are_written_and_read_back(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert main(["train", "--config", str(_job(tmp_path)), "--epochs", "2", "--run-dir", str(run)]) == 0
    metrics = _metrics(capsys)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "lr/dense", "lr/deep", "lr/wide", "valid/auc", "valid/logloss", "test/auc"} <= tags
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, metrics["steps"] + 1))
    csv = (run / "losses.csv").read_text().splitlines()[1:]
    assert [e.value for e in losses] == pytest.approx([float(line.split(",")[1]) for line in csv], rel=1e-6)
    assert events.Scalars("lr/deep")[0].value == pytest.approx(0.05)  # the job's deep_lr
    assert events.Scalars("test/auc")[-1].value == pytest.approx(metrics["test_auc"], rel=1e-6)
    assert len(events.Scalars("valid/auc")) == 2  # one per epoch


def test_no_tensorboard_when_turned_off(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", str(_job(tmp_path)), "--epochs", "1", "--logging.no_tensorboard",
                 "--run-dir", str(run)]) == 0
    assert not (run / "tensorboard").exists()


def test_traffic_scalars_count_the_collectives_of_a_data_parallel_step(tmp_path, cpu_ranks):
    """At 2 ranks the sampled steps' collective bytes hold DDP's all-reduce of the dense
    gradients (2 (n-1)/n of their bytes) and the host tables' sparse exchange on top; nothing
    is copied host <-> device where the device is the host."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conftest import hetero_on_ranks
    from hetero.embedding import dense_parameters
    from hetero.models.build import ModelKind, build_model, model_config
    from hetero.record import RECORD_KEY, RunRecord

    run = tmp_path / "run"
    got = hetero_on_ranks(tmp_path, 2, ["train", "--config", str(_job(tmp_path)), "--epochs", "2", "--run-dir", str(run)])
    assert got.returncode == 0, got.stderr
    record = RunRecord.from_state(torch.load(run / "checkpoint.pt")[RECORD_KEY], run)
    kind = ModelKind(record.model.kind)
    model = build_model(kind, model_config(kind, record.model.config), record.encoding.specs(), record.model.num_dense)
    ddp = sum(p.numel() * p.element_size() for p in dense_parameters(model)) * 2 * (2 - 1) / 2
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    dense = events.Scalars("traffic/dense_allreduce_bytes")
    sent = events.Scalars("traffic/collective_bytes")
    assert len(sent) >= 2 and [e.value for e in dense] == [ddp] * len(sent)  # sampled: after warm-up, epoch 2
    assert all(e.value > ddp for e in sent), (ddp, [e.value for e in sent])  # the sparse exchange on top
    assert all(e.value == 0 for e in events.Scalars("traffic/h2d_bytes"))
