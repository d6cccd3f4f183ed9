"""Parameter server (hetero.ps): 2 servers + 2 workers on gloo against one process."""

import datetime
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import CPU_RANKS, hetero_on_ranks, movielens, spawn, write_ml100k

from hetero import ps
from hetero.cli import main, merge
from hetero.dynamic import DynamicConfig, Keys
from hetero.embedding import HostEmbedding, HostEmbeddingCollection, TableConfig, init_rows
from hetero.optim import LazyAdam
from hetero.parallel import env
from hetero.ps.shard import build_shard

ARGS = ["--epochs", "2", "--batch-size", "64", "--no-progress", "--embedding-dim", "8", "--hidden", "16,8", "--dropout", "0"]
ENV = {**os.environ, **CPU_RANKS}


def _on_ranks(tmp_path, n, *args, check=True):
    run = hetero_on_ranks(tmp_path, n, ["train", *args])
    if check:
        assert run.returncode == 0, run.stderr[-3000:]
    return run


def _assert_same_training(ref_path, dcp_dir, tmp_path):
    """The parameter-server run's merged checkpoint equals the 1-process integrated one."""
    ref = torch.load(ref_path, map_location="cpu")  # a GPU run saves its dense parameters there
    got = torch.load(merge(dcp_dir, tmp_path / "merged.pt"))
    assert got["position"] == ref["position"]
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=0, atol=1e-5)
    for k, v in ref["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    for opt, saved in ref["sparse_optimizers"].items():
        assert got["sparse_optimizers"][opt]["steps"] == saved["steps"]
        for table, tensors in saved["state"].items():
            for s, v in tensors.items():
                torch.testing.assert_close(got["sparse_optimizers"][opt]["state"][table][s], v, rtol=0, atol=1e-5,
                                           msg=lambda m: f"{opt} {table} {s}: {m}")


def test_sync_mode_equals_one_process_with_tables_no_single_server_could_hold(tmp_path, ml_dir):
    data = [*movielens(ml_dir), *ARGS]
    assert main(["train", *data, "--run-dir", str(tmp_path / "one")]) == 0
    # What the whole tables need: a 1-server job reports it before allocating, on every rank, and stops.
    tiny = _on_ranks(tmp_path, 2, *data, "--ps-servers", "1", "--ps-server-memory-mb", "0.001", "--run-dir", str(tmp_path / "x"),
                     check=False)
    assert tiny.returncode != 0
    rows = re.search(r"hetero: error: parameter server rank 1 \(shard 0 of 1\): its table rows alone need ([0-9.]+) MiB, "
                     r"over its memory budget of 0.000999 MiB \(server_memory_bytes\); run more servers or raise the "
                     r"budget", tiny.stderr)
    assert rows, tiny.stderr[-3000:]
    # With the state of FTRL (wide) and LazyAdam (deep), two tensors of the table's shape each, one
    # server would need 3x the rows; each of two servers about half of that.
    budget = 0.6 * 3 * float(rows.group(1))
    _on_ranks(tmp_path, 4, *data, "--ps-servers", "2", "--ps-server-memory-mb", str(budget), "--run-dir", str(tmp_path / "ps"))
    assert sorted(p.name for p in (tmp_path / "ps" / "checkpoint.dcp").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    _assert_same_training(tmp_path / "one" / "checkpoint.pt", tmp_path / "ps" / "checkpoint.dcp", tmp_path)
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    two = json.loads((tmp_path / "ps" / "metrics.json").read_text())
    assert abs(one["test_auc"] - two["test_auc"]) < 1e-6
    started = two["ps_started_pulls"]  # both groups' (wide, deep) pulls of every step but an epoch's first: ahead
    assert started["taken"] >= 2 * (two["steps"] - two["epochs"]) and started["dropped"] == 0, started


def test_a_killed_server_restarts_the_job_from_the_last_checkpoint(tmp_path, ml_dir):
    data = [*movielens(ml_dir), *ARGS]
    assert main(["train", *data, "--run-dir", str(tmp_path / "one")]) == 0
    # pytorch/pytorch#135712: a separate rendezvous store per attempt (see docs/checkpoints.md)
    env_ = {"KILL_AT_STEP": "10", "KILL_MARKER": str(tmp_path / "killed"), "VICTIM_RANK": "3",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    helper = Path(__file__).parent / "helpers" / "kill_server_once.py"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          "--max-restarts", "1", str(helper), "train", *data, "--ps-servers", "2", "--ps-timeout", "20",
                          "--checkpoint-every", "4", "--resume", "auto", "--run-dir", str(tmp_path / "ps")],
                         capture_output=True, text=True, env={**ENV, **env_}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "killed").read_text() == "killed"  # server rank 3 died after step 10 ...
    assert "resumed from" in run.stderr and "at epoch 0, batch 8 (step 8)" in run.stderr  # ... the job went on from step 8
    _assert_same_training(tmp_path / "one" / "checkpoint.pt", tmp_path / "ps" / "checkpoint.dcp", tmp_path)


def test_servers_holding_their_shards_on_the_ssd_tier_train_as_in_memory_stopped_and_resumed(tmp_path, ml_dir):
    # Each server's shard of both groups (FTRL's wide, LazyAdam's deep) on its own tier under a cache of
    # about 200 records: every pull and push evicts. The reference: the same servers in memory, one run.
    base = [*movielens(ml_dir), *ARGS, "--epochs", "1"]
    _on_ranks(tmp_path, 4, *base, "--ps-servers", "2", "--run-dir", str(tmp_path / "mem"))
    ssd = [*base, "--table-storage", "ssd", "--cache-mb", "0.02", "--run-dir", str(tmp_path / "ssd")]
    _on_ranks(tmp_path, 4, *ssd, "--ps-servers", "2", "--max-steps", "7")
    _on_ranks(tmp_path, 4, *ssd, "--ps-servers", "2", "--resume")
    assert sorted(p.name for p in (tmp_path / "ssd" / "ssd").iterdir()) == ["rank2", "rank3"]  # the servers'
    shards = sorted(p.name for p in (tmp_path / "ssd" / "checkpoint.dcp" / "ps-tier").iterdir())
    assert shards == ["shard0of2", "shard1of2"]  # inside the DCP directory, swapped in with it
    mem = torch.load(merge(tmp_path / "mem" / "checkpoint.dcp", tmp_path / "a.pt"))
    got = torch.load(merge(tmp_path / "ssd" / "checkpoint.dcp", tmp_path / "b.pt"))  # the rows read from the snapshots
    assert got["position"] == mem["position"] and torch.equal(got["losses"], mem["losses"])
    assert got["model"].keys() == mem["model"].keys()
    for k, v in mem["model"].items():
        assert torch.equal(got["model"][k], v), k
    for opt, saved in mem["sparse_optimizers"].items():
        assert got["sparse_optimizers"][opt]["steps"] == saved["steps"]
        for table, tensors in saved["state"].items():
            assert tensors.keys() == got["sparse_optimizers"][opt]["state"][table].keys()
            for s, v in tensors.items():
                assert torch.equal(got["sparse_optimizers"][opt]["state"][table][s], v), (opt, table, s)
    # a resume with another number of servers is refused on every rank, naming what the checkpoint holds
    other = _on_ranks(tmp_path, 3, *ssd, "--ps-servers", "1", "--resume", check=False)
    assert other.returncode != 0 and "it holds ['shard0of2', 'shard1of2']" in other.stderr, other.stderr[-3000:]
    # a flipped byte in a server's snapshot: named on every rank before anything is loaded
    segment = sorted((tmp_path / "ssd" / "checkpoint.dcp" / "ps-tier" / "shard1of2").glob("*/*.seg"))[0]
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF
    segment.write_bytes(bytes(data))
    damaged = _on_ranks(tmp_path, 4, *ssd, "--ps-servers", "2", "--resume", check=False)
    assert damaged.returncode != 0 and segment.name in damaged.stderr, damaged.stderr[-3000:]


def test_async_mode_converges_to_the_auc_of_sync(tmp_path):
    """Sync mode is the 1-process run (previous tests); async reaches its test AUC within 0.01."""
    ml = write_ml100k(tmp_path / "ml", n_users=300, n_items=400, n_ratings=12000)
    data = [*movielens(ml), *ARGS, "--epochs", "3", "--batch-size", "256"]
    assert main(["train", *data, "--run-dir", str(tmp_path / "one")]) == 0
    _on_ranks(tmp_path, 4, *data, "--ps-servers", "2", "--ps-mode", "async", "--run-dir", str(tmp_path / "async"))
    sync = json.loads((tmp_path / "one" / "metrics.json").read_text())["test_auc"]
    asyn = json.loads((tmp_path / "async" / "metrics.json").read_text())["test_auc"]
    assert sync > 0.85 and abs(asyn - sync) <= 0.01, (sync, asyn)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_worker_beside_a_cpu_server_equals_one_cuda_process(tmp_path, ml_dir):
    """The CUDA path of a multi-process job: the worker's dense part on the GPU (its data-parallel
    group NCCL), the server on the CPU (gloo), rows through pinned buffers."""
    data = [*movielens(ml_dir), *ARGS]
    assert main(["train", *data, "--run-dir", str(tmp_path / "one")]) == 0  # one process, on the GPU
    env_ = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "hetero", "train", *data, "--ps-servers", "1", "--run-dir", str(tmp_path / "ps")],
                         capture_output=True, text=True, env={**env_, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "cuda" in run.stderr  # the worker announced its device
    _assert_same_training(tmp_path / "one" / "checkpoint.pt", tmp_path / "ps" / "checkpoint.dcp", tmp_path)


# ---------------------------------------------------------------------------------- spawned jobs
def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank, world, port, timeout_s=30.0):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def _table():
    torch.manual_seed(0)
    return HostEmbedding(TableConfig("items", 40, 4))


def _start(rank, world, port, config):
    """Join, split into servers and workers, build one table and its LazyAdam; a server serves
    inside job.start until the workers stop."""
    _join(rank, world, port)
    job = ps.PSJob.init(config)
    table = _table()
    job.shard_tables(table)
    opt = LazyAdam([table])
    job.start(table, {"items": opt})
    return job, table, opt


def _staleness_job(rank, world, port, out):
    job, table, opt = _start(rank, world, port, ps.PSConfig(num_servers=2, mode=ps.PSMode.BOUNDED, staleness=2))
    if job.role is ps.Role.WORKER:
        client = table.group.exchange
        ids = torch.tensor([1, 2, 3, 7, 8, 20, 33])  # the same rows every step: their cache entries age
        seen = []
        for _ in range(8):
            rows = table(ids)
            seen.append(rows.detach().clone())
            rows.sum().backward()
            ps.PSSparse(opt).step()
        c = client.cache
        changed = [not torch.equal(seen[t], seen[t - 1]) for t in range(1, 8)]
        Path(out, f"{rank}.json").write_text(json.dumps({"hits": c.hits, "misses": c.misses, "max_age": c.max_age,
                                                         "changed": changed}))
    job.shutdown()
    env.shutdown()


def test_bounded_staleness_reuses_a_row_for_at_most_k_steps(tmp_path, cpu_ranks):
    spawn(_staleness_job, args=(4, _port(), str(tmp_path)), nprocs=4)
    for worker in (0, 1):
        got = json.loads((tmp_path / f"{worker}.json").read_text())
        # 7 rows, steps 0..7, k = 2: pulled at steps 0, 3, 6 (an entry of age 3 is dropped), cached otherwise
        assert got["max_age"] == 2 and got["misses"] == 3 * 7 and got["hits"] == 5 * 7, got
        # the rows change exactly when they are pulled again (the servers applied the pushes meanwhile)
        assert got["changed"] == [False, False, True, False, False, True, False], got


def _bad_input_job(rank, world, port, out):
    job, table, _ = _start(rank, world, port, ps.PSConfig(num_servers=1, timeout_s=2))
    if job.role is ps.Role.WORKER:
        client = table.group.exchange
        try:
            client.pull(torch.tensor([3, 45]))  # past the worker's own check: the server must catch it
        except IndexError as e:
            Path(out, "index.txt").write_text(str(e))
        Path(out, "after.txt").write_text(str(client.pull(torch.tensor([3])).shape))  # the server went on serving
    job.shutdown()
    env.shutdown()


def _silent_server_job(rank, world, port, out):
    _join(rank, world, port)
    job = ps.PSJob.init(ps.PSConfig(num_servers=1, timeout_s=2))
    table = _table()
    job.shard_tables(table)
    if job.role is ps.Role.WORKER:
        t0 = time.perf_counter()
        try:
            table.group.exchange.pull(torch.tensor([3]))
        except ps.ServerTimeoutError as e:
            Path(out, "timeout.txt").write_text(f"{time.perf_counter() - t0:.1f}\n{e}")
    else:
        time.sleep(6)  # alive, but never serving
    os._exit(0)  # the worker's request is still pending: no orderly shutdown of the group


def test_a_server_rejects_an_out_of_range_id_with_the_table_name(tmp_path, cpu_ranks):
    spawn(_bad_input_job, args=(2, _port(), str(tmp_path)), nprocs=2)
    assert (tmp_path / "index.txt").read_text() == (
        "parameter server rank 1 (shard 0 of 1): table 'items': id 45 is out of range for vocab size 40 (valid ids are "
        "0..39); fix the feature encoding or set hashed=True")
    assert (tmp_path / "after.txt").read_text() == "torch.Size([1, 4])"


def test_an_unresponsive_server_is_a_timeout_naming_its_rank(tmp_path, cpu_ranks):
    spawn(_silent_server_job, args=(2, _port(), str(tmp_path)), nprocs=2)
    seconds, message = (tmp_path / "timeout.txt").read_text().split("\n", 1)
    assert 1.5 <= float(seconds) < 5
    assert message.startswith("parameter server rank 1 (shard 0 of 1) did not answer a pull of table group 'items' "
                              "within 2 s (PSConfig.timeout_s); is its process running and reachable from this worker?")


# ---------------------------------------------------------------------------------- in process
@pytest.mark.parametrize("servers", [1, 2, 3])
def test_server_shards_hold_exactly_the_rows_of_the_full_table(servers):
    torch.manual_seed(0)
    # (a dynamic table's rows: zeros, and its default row, which every server shard must lay out too)
    dynamic = TableConfig("d", 9, 3, keys=Keys.DYNAMIC, dynamic=DynamicConfig(default_value=0.5))
    coll = HostEmbeddingCollection([TableConfig("a", 5000, 3), TableConfig("b", 7, 3), dynamic, TableConfig("c", 4100, 3)])
    group = next(iter(coll.tables.values())).group
    assert len(group.tables) == 4 and int((group.storage == 0.5).all(1).sum()) == 1
    whole = torch.empty_like(group.storage)
    for s in range(servers):
        whole[s::servers] = build_shard(group, s, servers)  # global row g lives at g // S on shard g % S
    assert torch.equal(whole, group.storage)


def test_a_table_row_does_not_depend_on_how_the_table_is_split():
    torch.manual_seed(0)
    t = HostEmbedding(TableConfig("t", 10000, 5))
    for lo, hi in [(0, 1), (4095, 4097), (123, 9999), (8192, 10000)]:
        assert torch.equal(init_rows(t.config, t.init_seed, lo, hi), t.weight[lo:hi])


def test_deferred_tables_hold_no_rows_and_leave_the_random_stream_unchanged():
    from hetero.embedding import defer_tables

    torch.manual_seed(0)
    HostEmbedding(TableConfig("t", 1000, 4))
    after_built = torch.rand(3)
    defer_tables(True)
    try:
        torch.manual_seed(0)
        t = HostEmbedding(TableConfig("t", 1000, 4))
        assert torch.equal(torch.rand(3), after_built)  # the dense layers built next initialise the same
        huge = HostEmbedding(TableConfig("huge", 10**9, 64))  # 256 GB if it were built here
        assert huge.weight.is_meta and huge.group.storage.is_meta and not huge.group.local_dedup and t.weight.is_meta
        opt = LazyAdam([huge])
        assert all(x.is_meta for x in opt.group_state[huge.group].values())  # its state lives on the servers too
    finally:
        defer_tables(False)


def test_a_server_checks_each_id_for_its_range_and_its_shard(monkeypatch):
    from hetero.ps.config import PSMode
    from hetero.ps.server import ParameterServer
    from hetero.ps.transport import Status

    class Remote:
        global_rows = 100

    torch.manual_seed(0)
    group = HostEmbeddingCollection([TableConfig("a", 100, 4)]).tables["a"].group
    group.exchange = Remote()
    monkeypatch.setattr(dist, "get_rank", lambda *a: 2)
    server = ParameterServer({"g": group}, {}, 1, 2, [0], None, PSMode.SYNC, True)  # shard 1 of 2: the odd rows
    assert server._check(0, torch.tensor([1, 3, 99])) is None
    assert server._check(0, torch.tensor([], dtype=torch.int64)) is None
    kind, message = server._check(0, torch.tensor([1, 3, 4, 7]))
    assert kind is Status.VALUE_ERROR and "id 4 (group row 4) belongs to shard 0, not this one" in message
    for ids, bad in (([1, 101], 101), ([-1, 3], -1)):
        kind, message = server._check(0, torch.tensor(ids))
        assert kind is Status.INDEX_ERROR and f"table 'a': id {bad} is out of range for vocab size 100" in message


@pytest.mark.parametrize("tier", ["memory", "ssd"])
def test_a_servers_pull_reads_its_rows_into_the_last_pulls_buffer(tmp_path, tier):
    # a server answers a worker's pull in the memory of that worker's previous reply (no fresh pages
    # a pull): the same rows as a fresh read, repeats and a larger pull included
    from hetero.placement import StorageTier
    from hetero.storage.config import SsdConfig

    torch.manual_seed(0)
    on_ssd = {"storage": StorageTier.SSD, "ssd": SsdConfig(tmp_path, cache_bytes=4096)} if tier == "ssd" else {}
    group = HostEmbeddingCollection([TableConfig("a", 300, 4, **on_ssd)]).tables["a"].group
    buf = None
    for rows in ([5, 1, 5, 299], [7, 3], list(range(0, 300, 7)), [0]):
        rows = torch.tensor(rows)
        expected = torch.stack([group.read_rows(torch.tensor([r]))[0] for r in rows.tolist()])
        before = None if buf is None else (buf.untyped_storage().data_ptr(), buf.untyped_storage().nbytes())
        buf = group.read_rows(rows, buf)
        assert torch.equal(buf, expected) and buf.shape == (len(rows), 4)
        if before is not None and before[1] >= buf.numel() * 4:
            assert buf.untyped_storage().data_ptr() == before[0]  # (its memory, not a new tensor's)


def test_a_workers_tables_on_the_ssd_tier_hold_no_rows_and_reading_them_raises(tmp_path):
    # A parameter-server worker holds none of the rows: its state dicts keep meta placeholders (as in
    # memory), never a tier of initial rows that would pass for the servers'
    from hetero.embedding import RowExchange, RowPlacement
    from hetero.placement import StorageTier
    from hetero.storage.config import SsdConfig

    class Remote(RowExchange):
        placement = RowPlacement.PARAMETER_SERVER
        global_rows = 100

        def lookup(self, group, requests, plan):
            raise AssertionError("not looked up here")

    torch.manual_seed(0)
    coll = HostEmbeddingCollection([TableConfig("a", 100, 4, storage=StorageTier.SSD, ssd=SsdConfig(tmp_path))])
    group = coll.tables["a"].group
    group.exchange = Remote()
    opt = LazyAdam(list(coll.tables.values()))
    assert coll.state_dict()["tables.a.weight"].is_meta
    assert all(x.is_meta for x in opt.state_dict()["state"]["a"].values())
    with pytest.raises(ValueError, match=r"tables \['a'\] live on the parameter servers' SSD tier"):
        group.ssd_read(0, 10)
    assert not any(tmp_path.iterdir())  # no store laid out


def test_ps_config_and_launch_errors_name_the_fix(tmp_path, ml_dir, capsys, monkeypatch):
    with pytest.raises(ValueError, match=r"PSConfig.staleness=2 needs mode=PSMode.BOUNDED \(got sync\)"):
        ps.PSConfig(staleness=2)
    with pytest.raises(ValueError, match=r"PSConfig.num_servers must be >= 1, got 0"):
        ps.PSConfig(num_servers=0)
    for v in env.TORCHRUN_VARS:
        monkeypatch.delenv(v, raising=False)
    assert main(["train", *movielens(ml_dir), *ARGS, "--ps-servers", "2", "--run-dir", str(tmp_path)]) == 1
    assert ("hetero: error: a parameter server needs a multi-process job: launch with torchrun --nproc-per-node 2+W "
            "(servers + workers)") in capsys.readouterr().err


def test_a_single_host_job_binds_gloo_to_loopback(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    env._bind_loopback()
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # a multi-host job: the user's network
    monkeypatch.setenv("MASTER_ADDR", "localhost")  # torchrun --standalone
    env._bind_loopback()
    assert os.environ.get("GLOO_SOCKET_IFNAME") in ("lo", "lo0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    env._bind_loopback()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"  # the user's choice wins
