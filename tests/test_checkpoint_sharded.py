"""Sharded (DCP) checkpoints: merge equals the integrated checkpoint, resharding, bad shards."""

import os
import shutil
import socket

import pytest
import torch

from hetero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from hetero.cli import build_trainer, main, merge
from hetero.config import load_job

from conftest import movielens

ARGS = ["--epochs", "2", "--batch-size", "64", "--no-progress", "--embedding-dim", "8", "--hidden", "16,8", "--dropout", "0"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(r, n, port, ml_dir, run_dir):
    from hetero import parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r))
    torch.set_num_threads(1)
    assert parallel.init()
    try:
        job = load_job([*movielens(ml_dir), *ARGS, "--max-steps", "5", "--table-sharding", "row",
                        "--checkpoint-format", "sharded", "--run-dir", run_dir])
        trainer, _ = build_trainer(job)
        trainer.fit()  # ends with the sharded checkpoint at step 5
        state = trainer.state_dict()  # the integrated state of the same step (gathers the shards)
        if r == 0:
            save_checkpoint(state, os.path.join(run_dir, "integrated.pt"))
    finally:
        parallel.shutdown()


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    from conftest import CPU_RANKS, spawn, write_ml100k

    root = tmp_path_factory.mktemp("sharded")
    ml = write_ml100k(root / "ml-100k")
    with pytest.MonkeyPatch.context() as mpatch:  # the ranks run on the CPU (see conftest.CPU_RANKS)
        for k, v in CPU_RANKS.items():
            mpatch.setenv(k, v)
        spawn(_worker, args=(2, _free_port(), str(ml), str(root / "run")), nprocs=2)
    return root / "run", ml


def _assert_same(a, b, where="state"):
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), where
    if isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(set(a) ^ set(b))}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def test_per_rank_shards_merge_into_the_integrated_checkpoint_bitwise(two_rank_run, tmp_path):
    run, _ = two_rank_run
    shards = sorted(p.name for p in (run / "checkpoint.dcp").iterdir())
    assert shards == [".checksums.json", ".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its part
    merge(run / "checkpoint.dcp", tmp_path / "merged.pt")
    _assert_same(load_checkpoint(tmp_path / "merged.pt"), load_checkpoint(run / "integrated.pt"))
    # the command line's `hetero checkpoint merge SOURCE OUTPUT` writes the same file
    assert main(["checkpoint", "merge", str(run / "checkpoint.dcp"), str(tmp_path / "cli.pt")]) == 0
    _assert_same(load_checkpoint(tmp_path / "cli.pt"), load_checkpoint(run / "integrated.pt"))


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_shard_is_a_clear_error_and_nothing_is_overwritten(two_rank_run, tmp_path, damage, capsys):
    run, ml = two_rank_run
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    shard = bad / "checkpoint.dcp" / "__1_0.distcp"
    if damage == "missing":
        shard.unlink()
        expected = (f"sharded checkpoint {bad / 'checkpoint.dcp'}: shard file __1_0.distcp is missing; the checkpoint is "
                    f"incomplete (copy every __<rank>_0.distcp file of it, or resume from another checkpoint)")
    else:
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            f.truncate(size // 2)
        expected = (f"sharded checkpoint {bad / 'checkpoint.dcp'}: shard file __1_0.distcp is truncated ({size // 2} bytes, "
                    f"{size} expected); resume from another checkpoint")
    before = {p.name: p.read_bytes() for p in (bad / "checkpoint.dcp").iterdir()}
    with pytest.raises(CheckpointError) as e:
        merge(bad / "checkpoint.dcp", tmp_path / "merged.pt")
    assert str(e.value) == expected
    assert not (tmp_path / "merged.pt").exists()
    # resume in one process: the same error, before the model is touched; the checkpoint stays as it was
    assert main(["train", *movielens(ml), *ARGS, "--checkpoint-format", "sharded", "--resume",
                 "--run-dir", str(bad)]) == 1
    assert f"hetero: error: {expected}" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (bad / "checkpoint.dcp").iterdir()} == before


def test_a_checkpoint_of_another_table_size_names_the_table_and_both_shapes(two_rank_run, tmp_path, capsys):
    run, ml = two_rank_run
    shutil.copytree(run, tmp_path / "run")
    assert main(["train", *movielens(ml), *ARGS, "--embedding-dim", "4", "--checkpoint-format", "sharded",
                 "--resume", "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    # the run record names it before any shard is read
    assert "checkpoint.dcp was trained with another model (config.embedding_dim: 8 in the checkpoint, 4 in this run)" in err
    assert "resume with the job it was saved with" in err


def test_an_interrupted_swap_falls_back_to_the_previous_checkpoint(two_rank_run, tmp_path):
    from hetero.checkpoint.sharded import resolve

    run, _ = two_rank_run
    d = tmp_path / "checkpoint.dcp"
    shutil.copytree(run / "checkpoint.dcp", d.with_name("checkpoint.dcp.old"))  # crash between the two renames
    (tmp_path / "checkpoint.dcp.tmp").mkdir()  # a half-written new one
    assert resolve(d) == d.with_name("checkpoint.dcp.old")
    merge(d, tmp_path / "merged.pt")


class _Payload:
    """A pickle that runs a shell command when unpickled (what a crafted .metadata holds)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_metadata_pickle_runs_no_code_on_merge_or_resume(two_rank_run, tmp_path, capsys):
    import pickle

    run, ml = two_rank_run
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    marker = tmp_path / "pwned"
    (bad / "checkpoint.dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match=r"unreadable \.metadata \(refused global posix\.system"):
        merge(bad / "checkpoint.dcp", tmp_path / "merged.pt")
    assert main(["train", *movielens(ml), *ARGS, "--checkpoint-format", "sharded", "--resume",
                 "--run-dir", str(bad)]) == 1
    assert "refused global posix.system" in capsys.readouterr().err
    assert not marker.exists()


def _flip_4k(path):
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\xff" * 4096)


def test_a_corrupted_shard_or_file_is_detected_naming_it(two_rank_run, tmp_path, capsys):
    run, ml = two_rank_run
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    _flip_4k(bad / "checkpoint.dcp" / "__1_0.distcp")
    expected = (f"sharded checkpoint {bad / 'checkpoint.dcp'}: __1_0.distcp is corrupted (its SHA-256 differs from the "
                f"one written with it); resume from another checkpoint")
    with pytest.raises(CheckpointError) as e:
        merge(bad / "checkpoint.dcp", tmp_path / "merged.pt")
    assert str(e.value) == expected
    assert main(["train", *movielens(ml), *ARGS, "--checkpoint-format", "sharded", "--resume",
                 "--run-dir", str(bad)]) == 1
    assert expected in capsys.readouterr().err
    # the integrated format: the zip archive's CRC-32 per record
    _flip_4k(bad / "integrated.pt")
    with pytest.raises(CheckpointError, match=r"integrated.pt is corrupted: record .* fails its CRC-32 check"):
        load_checkpoint(bad / "integrated.pt")
