"""Data parallel on gloo: N ranks x batch B/N equal 1 process x batch B."""

import os
import socket

import pytest
import torch
from torch import nn

from conftest import hetero_on_ranks, make_dataset, movielens, spawn

from hetero.data import BatchConfig, Batches, FeatureRole
from hetero.dynamic import DynamicConfig
from hetero.embedding import RowPlacement, dense_parameters, host_tables
from hetero.models.wide_deep import FeatureSlot, WideDeep, WideDeepConfig
from hetero.optim import FTRL, LazyAdam
from hetero.parallel import (
    CommFusion,
    DataParallelConfig,
    DistributedSparse,
    check_replicas,
    data_parallel,
    full_model_state,
    global_batch_mean,
    init,
    rank,
    shard_rows,
    shutdown,
    world_size,
)

STEPS, BATCH = 6, 32


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _global_loss(loss):
    if world_size() > 1:
        loss = loss.detach().clone()
        torch.distributed.all_reduce(loss)
        loss /= world_size()
    return loss.item()


def _mlp_run(mean: bool, scale: float):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1))
    net = data_parallel(model, DataParallelConfig(CommFusion(allreduce=0.0001), gradients_mean=mean))  # tiny buckets: several
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = make_dataset(STEPS * BATCH)
    batches = Batches(data, BatchConfig(batch_size=BATCH, shuffle=True, seed=3, rank=rank(), world_size=world_size()))
    losses = []
    for batch in batches.epoch(0):
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(batch.dense).squeeze(1), batch.label)
        (loss * scale).backward()
        opt.step()
        losses.append(_global_loss(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _wide_deep_run(mean: bool, scale: float, sharded: bool = False, samples: int = STEPS * BATCH, batch_size: int = BATCH,
                   dynamic: bool = False, capped: bool = True):
    torch.manual_seed(0)
    data = make_dataset(samples)
    # dynamic: ids as raw keys, admitted at the second sighting, 40 rows a table (evicting over the steps; more
    # than a batch's keys: which keys a full step refuses depends on their order, the ranks' or the batch's)
    # (uncapped: rows for every key - row-sharded, each rank's span is a part of the capacity, so a capped
    # table evicts other keys than one process would)
    slots = [FeatureSlot(f.name, min(f.vocab_size, 40) if dynamic and capped else f.vocab_size, f.multi_hot,
                         deep=f.role is not FeatureRole.WIDE,
                         dynamic=DynamicConfig(admit_after=2, evict_chunk=8) if dynamic else None) for f in data.specs]
    model = WideDeep(slots, data.num_dense, WideDeepConfig(embedding_dim=4, hidden=(8,)))
    if sharded:
        assert shard_rows(model) == (2 if world_size() > 1 else 0)  # wide (dim 1) and deep (dim 4) groups
    check_replicas(model)
    net = data_parallel(model, DataParallelConfig(gradients_mean=mean))
    tables = host_tables(model)
    sparse = [DistributedSparse(FTRL({k: t for k, t in tables.items() if k.startswith("wide.")}), DataParallelConfig(gradients_mean=mean)),
              DistributedSparse(LazyAdam({k: t for k, t in tables.items() if k.startswith("deep.")}), DataParallelConfig(gradients_mean=mean))]
    dense = torch.optim.Adam(dense_parameters(model), lr=1e-2)
    batches = Batches(data, BatchConfig(batch_size=batch_size, shuffle=True, seed=3, rank=rank(), world_size=world_size()))
    losses = []
    for batch in batches.epoch(0):
        for o in (*sparse, dense):
            o.zero_grad()
        logits = net(batch.features, batch.dense)
        if world_size() == 1:  # the reference: torch's plain batch mean
            loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.label)
        else:
            loss = global_batch_mean(nn.functional.binary_cross_entropy_with_logits(logits, batch.label, reduction="sum"),
                                     batch.global_size)
        (loss * scale).backward()
        for o in (*sparse, dense):
            o.step()
        losses.append(_global_loss(loss))
    if sharded and world_size() > 1:  # each rank holds a 1/N block of every group's rows
        for name, t in host_tables(model).items():
            g = t.group
            assert g.exchange.placement is RowPlacement.ROW_SHARDED and g.storage.shape[0] <= -(-g.exchange.global_rows // world_size()), name
    state = full_model_state(model)  # sharded tables gathered whole
    return losses, _by_key({k: v.detach().clone() for k, v in state.items()})


def _by_key(state):
    """A dynamic table's rows (and their counts and last steps) in key order: the rows a key gets
    depend on the order keys arrive (rank by rank, or in one batch), their values do not."""
    for prefix in [k[: -len("keymap.row_key")] for k in state if k.endswith("keymap.row_key")]:
        held = torch.nonzero(state[f"{prefix}keymap.row_last"] >= 0).squeeze(1)
        at = held[torch.argsort(state[f"{prefix}keymap.row_key"][held])]
        state[f"{prefix}weight"] = torch.cat([state[f"{prefix}weight"][at], state[f"{prefix}weight"][-1:]])
        for name in ("row_key", "row_count", "row_last"):
            state[f"{prefix}keymap.{name}"] = state[f"{prefix}keymap.{name}"][at]
    return state


RUNS = {"mlp": _mlp_run, "wide_deep": _wide_deep_run,
        "wide_deep_sharded": lambda mean, scale: _wide_deep_run(mean, scale, sharded=True),
        # 97 samples in batches of 16: the last batch has 1 sample, so at 4 ranks three shares are empty
        "wide_deep_uneven": lambda mean, scale: _wide_deep_run(mean, scale, samples=97, batch_size=16),
        "wide_deep_sharded_uneven": lambda mean, scale: _wide_deep_run(mean, scale, sharded=True, samples=97, batch_size=16),
        # dynamic tables replicated: every rank admits every rank's keys (hetero.parallel.replicated_keys)
        "wide_deep_dynamic": lambda mean, scale: _wide_deep_run(mean, scale, samples=12 * BATCH, dynamic=True),
        "wide_deep_dynamic_uneven": lambda mean, scale: _wide_deep_run(mean, scale, samples=97, batch_size=16,
                                                                       dynamic=True),
        # row-sharded: each rank admits, counts and evicts the keys it owns (hetero.parallel.sharded_keys)
        "wide_deep_dynamic_sharded": lambda mean, scale: _wide_deep_run(mean, scale, sharded=True, samples=12 * BATCH,
                                                                        dynamic=True, capped=False),
        "wide_deep_dynamic_sharded_uneven": lambda mean, scale: _wide_deep_run(
            mean, scale, sharded=True, samples=97, batch_size=16, dynamic=True, capped=False)}


def _worker(r, n, port, kind, mean, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r))
    torch.set_num_threads(1)
    assert init()
    try:
        result = RUNS[kind](mean, 1.0)
        if r == 0:
            torch.save(result, out)
    finally:
        shutdown()


def _distributed(tmp_path, kind, n, mean):
    out = tmp_path / f"{kind}_{n}_{mean}.pt"
    spawn(_worker, args=(n, _free_port(), kind, mean, str(out)), nprocs=n)
    return torch.load(out, map_location="cpu")


# each layout at 2 and 4 ranks, each with a mean and a sum somewhere (not the full cross product:
# the matrix of 14 spawned jobs was a minute and a half of CI for little more coverage)
@pytest.mark.parametrize("kind,n,mean", [("mlp", 2, True), ("mlp", 2, False), ("wide_deep", 2, False), ("wide_deep", 4, True),
                                         ("wide_deep_sharded", 2, False), ("wide_deep_sharded", 4, True),
                                         ("wide_deep_uneven", 4, False), ("wide_deep_sharded_uneven", 4, True),
                                         ("wide_deep_dynamic", 2, False), ("wide_deep_dynamic_uneven", 4, True),
                                         ("wide_deep_dynamic_sharded", 2, True), ("wide_deep_dynamic_sharded_uneven", 4, False)],
                         ids=lambda v: {True: "mean", False: "sum"}.get(v) if isinstance(v, bool) else str(v))
def test_n_ranks_equal_one_process(tmp_path, kind, n, mean, cpu_ranks):
    # gradients_mean=False sums the ranks' gradients: the single-process equivalent is a loss
    # scaled by the world size.
    ref_losses, ref_state = RUNS[kind](True, 1.0 if mean else float(n))
    losses, state = _distributed(tmp_path, kind, n, mean)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")


def _untouched_shard_worker(r, n, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r))
    assert init()
    try:
        from hetero.embedding import HostEmbedding, TableConfig

        torch.manual_seed(0)
        table = HostEmbedding(TableConfig("t", 100, 4))
        shard_rows(table)
        opt = DistributedSparse(LazyAdam([table]))
        for _ in range(3):
            opt.zero_grad()
            table(torch.tensor([1, 7, 30])).sum().backward()  # rows of rank 0's block only
            opt.step()
        torch.save(opt.optimizer.steps, f"{out}.{r}")
    finally:
        shutdown()


def test_a_shard_the_batch_missed_still_counts_the_step(tmp_path, cpu_ranks):
    """LazyAdam's bias correction uses the table's step count: equal on every shard, as in one process."""
    spawn(_untouched_shard_worker, args=(2, _free_port(), str(tmp_path / "steps")), nprocs=2)
    assert torch.load(tmp_path / "steps.0") == torch.load(tmp_path / "steps.1") == {"t": 3}


def test_shards_are_disjoint_covering_and_interleaved():
    data = make_dataset(64)
    full = next(Batches(data, BatchConfig(batch_size=16, seed=1)).epoch(2))
    parts = [next(Batches(data, BatchConfig(batch_size=16, seed=1, rank=r, world_size=4)).epoch(2)) for r in range(4)]
    for r, part in enumerate(parts):
        assert torch.equal(part.dense, full.dense[r::4])  # sample i of the global batch -> rank i mod 4


def test_bad_distributed_input_names_value_and_fix(monkeypatch):
    with pytest.raises(ValueError, match="global batch size 30 is not divisible by world size 4; use a multiple of 4"):
        Batches(make_dataset(8), BatchConfig(batch_size=30, world_size=4, rank=1))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for v in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(ValueError, match="distributed environment incomplete: LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set "
                                         r"\(found RANK, WORLD_SIZE\); launch with `torchrun --nproc-per-node N"):
        init()
    # NCCL needs one GPU per rank: a second rank on a one-GPU node is refused before any collective.
    for k, v in dict(LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", RANK="1",
                     GLOO_SOCKET_IFNAME="lo").items():  # the last one keeps init's loopback binding inside this test
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"^LOCAL_RANK=1 has no CUDA device: this node has 1 \(torch.cuda.device_count\(\)\); "
                                         r"start at most 1 process\(es\) per node with `torchrun --nproc-per-node 1`, or "
                                         r"train on the CPU with gloo by hiding the GPUs \(CUDA_VISIBLE_DEVICES=\)$"):
        init()


def test_world_size_one_is_a_single_process(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    assert init() is False and rank() == 0 and world_size() == 1
    model = nn.Linear(2, 2)
    assert data_parallel(model) is model


def test_a_killed_rank_restarts_from_the_checkpoint_and_finishes_sample_exact(tmp_path, ml_dir, cpu_ranks):
    import subprocess
    import sys
    from pathlib import Path

    args = [*movielens(ml_dir), "--epochs", "2", "--batch-size", "64", "--no-progress", "--embedding-dim", "8",
            "--hidden", "16,8", "--dropout", "0", "--checkpoint-every", "4", "--resume", "auto"]
    # pytorch/pytorch#135712: with the rendezvous store shared, restarted workers can read the
    # previous attempt's addresses; a separate store per attempt avoids it (documented in docs/checkpoints.md).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL_AT_STEP": "10", "KILL_MARKER": str(tmp_path / "killed"),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    helper = Path(__file__).parent / "helpers" / "kill_once.py"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "--max-restarts", "1", str(helper), "train", *args, "--run-dir", str(tmp_path / "killed_run")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "killed").exists()  # rank 1 was killed mid-epoch 1 (15 steps per epoch) ...
    assert "resumed from" in run.stderr and "at epoch 0, batch 8 (step 8)" in run.stderr  # ... and restarted
    clean = hetero_on_ranks(tmp_path, 2, ["train", *args, "--run-dir", str(tmp_path / "clean_run")])
    assert clean.returncode == 0, clean.stderr[-2000:]
    a = torch.load(tmp_path / "killed_run" / "checkpoint.pt", map_location="cpu")
    b = torch.load(tmp_path / "clean_run" / "checkpoint.pt", map_location="cpu")
    assert a["position"] == b["position"] == {"epoch": 2, "batch": 0, "global_step": 30}
    for k in b["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert (tmp_path / "killed_run" / "losses.csv").read_text() == (tmp_path / "clean_run" / "losses.csv").read_text()


@pytest.mark.parametrize("layout", [("integrated", "replicated"), ("sharded", "row")], ids=["integrated", "sharded"])
def test_checkpoint_saved_at_4_ranks_resumes_at_2_and_1(tmp_path, ml_dir, layout, cpu_ranks):
    """Integrated: every tensor whole in one file. Sharded: each rank writes its block of the
    row-sharded tables (torch.distributed.checkpoint), and loading at 2 ranks or 1 reshards them.
    The position counts global batches, so both continue under any world size."""
    import shutil

    from hetero.cli import main, merge

    fmt, sharding = layout
    args = [*movielens(ml_dir), "--epochs", "2", "--batch-size", "64", "--no-progress", "--embedding-dim", "8",
            "--hidden", "16,8", "--dropout", "0", "--checkpoint-format", fmt]

    def on_ranks(n, *extra):
        run = hetero_on_ranks(tmp_path, n, ["train", *args, "--table-sharding", sharding, *extra])
        assert run.returncode == 0, run.stderr[-2000:]

    def final(name):
        if fmt == "integrated":
            return torch.load(tmp_path / name / "checkpoint.pt", map_location="cpu")  # a GPU run's dense params
        return torch.load(merge(tmp_path / name / "checkpoint.dcp", tmp_path / name / "merged.pt"))

    assert main(["train", *args, "--run-dir", str(tmp_path / "one")]) == 0  # the uninterrupted 1-rank run
    on_ranks(4, "--max-steps", "7", "--run-dir", str(tmp_path / "four"))  # mid-epoch 1 of 15 steps
    if fmt == "sharded":
        assert len(list((tmp_path / "four" / "checkpoint.dcp").glob("__*_0.distcp"))) == 4
    shutil.copytree(tmp_path / "four", tmp_path / "two")
    on_ranks(2, "--resume", "--run-dir", str(tmp_path / "two"))
    shutil.copytree(tmp_path / "four", tmp_path / "single")
    assert main(["train", *args, "--resume", "--run-dir", str(tmp_path / "single")]) == 0
    reference = final("one")
    ref_losses = reference["losses"]
    for name in ("two", "single"):
        state = final(name)
        assert state["position"] == reference["position"]
        torch.testing.assert_close(state["losses"], ref_losses, rtol=0, atol=1e-5)
        for k, v in reference["model"].items():
            torch.testing.assert_close(state["model"][k], v, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {k}: {m}")
        for opt, saved in reference["sparse_optimizers"].items():
            for table, tensors in saved["state"].items():
                for s, v in tensors.items():
                    torch.testing.assert_close(state["sparse_optimizers"][opt]["state"][table][s], v, rtol=0, atol=1e-5,
                                               msg=lambda m: f"{name}: {opt} {table} {s}: {m}")


OFF_NETWORK = "unshare --net --map-root-user -- sh -c 'ip link set lo up && exec \"$@\"' sh"


def test_the_documented_single_host_launch_listens_on_no_network_interface(cpu_ranks):
    # torchrun's agent binds its stores to every interface whatever the host it is given
    # (pytorch/pytorch#173909); the documented single-host launch (docs/parameter-server.md) runs the job in a network
    # namespace of its own, where only loopback exists. Seen from this host: no listener at all.
    import shlex
    import shutil
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert OFF_NETWORK in (root / "docs" / "parameter-server.md").read_text()
    if shutil.which("unshare") is None or subprocess.run(shlex.split(OFF_NETWORK) + ["true"]).returncode != 0:
        pytest.skip("no network namespaces here (unshare --net is not permitted)")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    job = subprocess.Popen(shlex.split(OFF_NETWORK) + [torchrun, "--standalone", "--nproc-per-node", "2",
                                                        str(root / "tests" / "helpers" / "hold_group.py")])
    try:
        time.sleep(3)  # the agent's stores and gloo's sockets are up
        listeners = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
        assert "pt_elastic" not in listeners and f"pid={job.pid}," not in listeners, listeners
    finally:
        assert job.wait(timeout=60) == 0


def _replica_check(rows: int, differ: bool):
    import resource

    from hetero.embedding import HostEmbedding, TableConfig

    torch.manual_seed(0)
    model = nn.Module()
    model.table = HostEmbedding(TableConfig("t", rows, 32))
    if differ and rank() == 1:
        model.table.weight.data[rows // 2, 3] += 1.0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the peak so far
    try:
        check_replicas(model)
        error = None
    except ValueError as e:
        error = str(e)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return error, grew * 1024


def test_replica_check_reads_tables_in_place_and_finds_one_changed_value(tmp_path, cpu_ranks):
    from conftest import run_ranks

    rows = 1 << 21  # 2M x 32 fp32 = 256 MiB: a float64 copy would add 512 MiB to the peak
    error, grew = run_ranks(tmp_path, 2, _replica_check, rows, False)
    assert error is None and grew < 32 << 20, f"peak memory grew by {grew / 2**20:.0f} MiB"
    error, _ = run_ranks(tmp_path, 2, _replica_check, 1000, True)
    assert error == "host table 'table' differs between ranks; build the model with the same seed on every rank"


# (tp at 4 ranks is the operator-parallel tests'; here each format with tp and with ZeRO)
@pytest.mark.parametrize("fmt,n,mode", [("integrated", 2, "tp"), ("sharded", 2, "tp"),
                                        ("integrated", 2, "zero1"), ("sharded", 2, "zero3")])
def test_wide_deep_with_a_sharded_dense_part_trains_and_resumes_as_one_process(tmp_path, ml_dir, fmt, n, mode, cpu_ranks):
    """``hetero train --tp N``: the deep MLP column/row-parallel over N ranks, the host tables
    replicated. ``--zero 1`` / ``--zero 3``: the dense part's Adam state (and parameters) sharded
    over N data-parallel ranks. Stopped mid-epoch, resumed on N ranks and in one process (another
    layout), each ends where one uninterrupted process ends."""
    import json
    import shutil

    from hetero.cli import main, merge

    tp = n if mode == "tp" else 1
    args = [*movielens(ml_dir), "--epochs", "2", "--batch-size", "64", "--no-progress", "--embedding-dim", "8",
            "--hidden", "16,8", "--dropout", "0", "--checkpoint-format", fmt]
    sharding = ["--tp", str(n)] if mode == "tp" else ["--zero", mode[-1]]

    def on_ranks(*extra):
        run = hetero_on_ranks(tmp_path, n, ["train", *args, *sharding, *extra])
        assert run.returncode == 0, run.stderr[-2000:]
        return run

    def final(name):
        if fmt == "integrated":
            return torch.load(tmp_path / name / "checkpoint.pt", map_location="cpu")
        return torch.load(merge(tmp_path / name / "checkpoint.dcp", tmp_path / name / "merged.pt"))

    assert main(["train", *args, "--run-dir", str(tmp_path / "one")]) == 0
    run = on_ranks("--max-steps", "7", "--run-dir", str(tmp_path / "sharded"))  # mid-epoch 1
    if mode == "tp":
        # 16,8 hidden over w inputs: mlp.0 (weight, bias) column-parallel, mlp.2's weight row-parallel;
        # mlp.2's bias and mlp.4 (8 -> 1) whole. The bytes are the ranks' live local shards.
        line = next(ln for ln in run.stderr.splitlines() if "deep MLP operator-parallel" in ln)
        local, whole = (int(x) for x in line.split("sharded, ")[1].split(" bytes")[0].split(" of "))
        w = (whole // 4 - (16 + 8 * 16 + 8 + 8 + 1)) // 16
        assert whole == 4 * (16 * w + 16 + 8 * 16 + 8 + 8 + 1)
        assert f"over {tp} ranks: 3 parameters sharded" in line
        assert local == 4 * (16 * w // tp + 16 // tp + 8 * 16 // tp + 8 + 8 + 1)
        strategy = json.loads((tmp_path / "sharded" / "strategy.json").read_text())
        assert strategy["mesh"] == {"shape": [1, 1, tp], "dim_names": ["pp", "dp", "tp"]}
        assert strategy["layout"]["mlp.0.weight"] == ["R", "R", "S(0)"]
        assert strategy["layout"]["mlp.2.weight"] == ["R", "R", "S(1)"]
    else:  # this rank's share of the dense parameters, from its optimizer: stage 1 partitions whole
        # parameters (the largest, mlp.0.weight, alone on rank 0), stage 3 shards each one in halves
        line = next(ln for ln in run.stderr.splitlines() if "ZeRO stage" in ln)
        mine, whole = (int(x) for x in line.split("updates ")[1].split(" dense")[0].split(" of "))
        assert f"stage {mode[-1]} over 2 data-parallel ranks" in line, line
        assert mine < whole and (mode == "zero1" or 0.45 * whole < mine < 0.55 * whole), line
    shutil.copytree(tmp_path / "sharded", tmp_path / "resumed")
    on_ranks("--resume", "--run-dir", str(tmp_path / "resumed"))
    shutil.copytree(tmp_path / "sharded", tmp_path / "single")
    assert main(["train", *args, "--resume", "--run-dir", str(tmp_path / "single")]) == 0
    reference = final("one")
    for name in ("resumed", "single"):
        state = final(name)
        assert state["position"] == reference["position"]
        torch.testing.assert_close(state["losses"], reference["losses"], rtol=0, atol=1e-5)
        for k, v in reference["model"].items():
            assert type(state["model"][k]) is torch.Tensor and state["model"][k].shape == v.shape, k
            torch.testing.assert_close(state["model"][k], v, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {k}: {m}")
        for i, st in reference["dense_optimizer"]["state"].items():
            for s, v in st.items():
                torch.testing.assert_close(state["dense_optimizer"]["state"][i][s], v, rtol=0, atol=1e-5)


def test_tp_without_its_ranks_or_with_sharded_tables_is_refused_naming_the_fix(tmp_path, ml_dir, capsys):
    from hetero.cli import main

    base = ["train", *movielens(ml_dir), "--epochs", "1", "--no-progress", "--run-dir", str(tmp_path)]
    assert main([*base, "--tp", "2"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hetero: error: parallelism.tp = 2 (--tp) runs every rank of hetero train in it: start torchrun --nproc-per-node "
        "2 (this job has 1 ranks); tp x dp is hetero.apply's (a plan over a pp x dp x tp mesh), not yet hetero train's")
    assert main([*base, "--tp", "2", "--table-sharding", "row"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hetero: error: parallelism.tp (--tp) with parallelism.table_sharding (--table-sharding row): operator "
        "parallelism runs with replicated host tables and no other dimension; drop one")
