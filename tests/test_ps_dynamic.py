"""Dynamic tables on parameter servers (hetero.ps.keys): the key maps on the servers, in sync
mode against data-parallel training and one process, stopped and resumed, merged and predicted;
the modes that could mix keys' gradients are refused."""

import json

import numpy as np
import pytest
import torch

from conftest import hetero_on_ranks
from test_dynamic_job import JOB, TRAIN, _csv

from hetero.cli import main, merge
from hetero.ps.keys import ShardSpan, key_shards, whole_keymaps

ARGS = [*TRAIN, "--dropout", "0"]
TABLES = ("wide.tables.wide_user", "wide.tables.wide_item", "deep.tables.deep_user", "deep.tables.deep_item")


def _job(tmp_path, *replace):
    data = tmp_path / "ids.csv"
    _csv(data)
    text = JOB.format(data=data, extra="")
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    job = tmp_path / "job.toml"
    job.write_text(text)
    return data, job


def _ps(tmp_path, job, name, servers, extra=()):
    run = hetero_on_ranks(tmp_path, servers + 2, ["train", "--config", str(job), *ARGS, "--run-dir", str(tmp_path / name),
                                                  "--ps-servers", str(servers), *extra])
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(merge(tmp_path / name / "checkpoint.dcp", tmp_path / f"{name}.pt"), weights_only=False)


def _by_key(model, table):
    """A dynamic table's rows by key: key -> (row value, use count, last step)."""
    last = model[f"{table}.keymap.row_last"]
    return {int(model[f"{table}.keymap.row_key"][r]): (model[f"{table}.weight"][r], int(model[f"{table}.keymap.row_count"][r]),
                                                      int(last[r])) for r in (last >= 0).nonzero().flatten().tolist()}


def test_one_sync_server_trains_capped_dynamic_tables_as_data_parallel_workers_do(tmp_path, cpu_ranks):
    """1 server, 2 workers: the run equals the same 2 ranks training replicated (which admit and
    evict every rank's keys in rank order, as the server does), tensor for tensor - the key maps
    included, with the user tables evicting and refusing keys, where the order keys come in matters."""
    data, job = _job(tmp_path)
    run = hetero_on_ranks(tmp_path, 2, ["train", "--config", str(job), *ARGS, "--run-dir", str(tmp_path / "dp")])
    assert run.returncode == 0, run.stderr[-3000:]
    ref = torch.load(tmp_path / "dp" / "checkpoint.pt", weights_only=False)
    got = _ps(tmp_path, job, "ps", 1)
    assert set(got["model"]) == set(ref["model"])
    for k, v in ref["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=0, atol=1e-6)
    for opt, saved in ref["sparse_optimizers"].items():
        for table, fields in saved["state"].items():
            for f, v in fields.items():
                torch.testing.assert_close(got["sparse_optimizers"][opt]["state"][table][f], v, rtol=0, atol=1e-6)
    stats = ref["model"]["deep.tables.deep_user.keymap.stats"].tolist()
    assert stats[1] > 0 and stats[2] > 0  # evicting and refusing
    dp, ps = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("dp", "ps"))
    assert dp["dynamic_tables"] == ps["dynamic_tables"] and dp["test_auc"] == pytest.approx(ps["test_auc"], abs=1e-6)


def test_two_sync_servers_train_as_one_process_key_by_key_and_resume_exactly_on_the_ssd_tier(tmp_path, cpu_ranks):
    """2 servers, 2 workers, tables with room for every key (admitted at the second sighting, aged
    out after 6 steps): each key's row, use count and last step equal one process's; the servers'
    shards on the SSD tier under a cache of a few records, stopped at step 5 and resumed, equal
    the straight run in memory tensor for tensor; the merged checkpoint predicts as one process's."""
    data, job = _job(tmp_path, ("capacity = 24", "capacity = 80"))
    assert main(["train", "--config", str(job), *ARGS, "--run-dir", str(tmp_path / "one")]) == 0
    ref = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)["model"]
    straight = _ps(tmp_path, job, "ps", 2)
    ssd = ["--table-storage", "ssd", "--cache-mb", "0.004"]
    _ps(tmp_path, job, "split", 2, [*ssd, "--max-steps", "5"])
    split = _ps(tmp_path, job, "split", 2, [*ssd, "--resume"])
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoint.dcp" / "ps-tier").iterdir()) == ["shard0of2", "shard1of2"]
    for k, v in straight["model"].items():
        assert torch.equal(v, split["model"][k]), k
    assert torch.equal(straight["losses"], split["losses"])
    for table in TABLES:
        want, got = _by_key(ref, table), _by_key(straight["model"], table)
        assert set(want) == set(got), table
        for key, (row, count, last) in want.items():
            assert (count, last) == got[key][1:], (table, key)
            torch.testing.assert_close(got[key][0], row, rtol=0, atol=1e-5)
    assert int(ref["deep.tables.deep_user.keymap.stats"][1]) > 0  # aged out: the clock ran on the servers
    for name in ("one", "ps"):
        at = tmp_path / name / "checkpoint.pt" if name == "one" else tmp_path / "ps.pt"
        assert main(["predict", "--checkpoint", str(at), "--data", str(data), "--out", str(tmp_path / f"{name}.csv")]) == 0
    scores = [np.loadtxt(tmp_path / f"{n}.csv", delimiter=",", skiprows=1, usecols=0) for n in ("one", "ps")]
    np.testing.assert_allclose(scores[0], scores[1], atol=1e-5)
    assert len(set(scores[1].round(6))) > 20


def test_a_server_whose_shard_a_step_missed_still_counts_the_step(tmp_path, cpu_ranks):
    """3 servers, one sample per worker and step: many steps touch no row of a shard, whose clock
    (the tables' age, ``ttl_steps = 6``) must still advance; each key's use count, last step and
    the keys aged out equal one process's."""
    data, job = _job(tmp_path, ("capacity = 24", "capacity = 80"))
    small = ["--batch-size", "2", "--epochs", "1", "--max-steps", "60"]  # (60 of the epoch's 200 steps: keys age out)
    assert main(["train", "--config", str(job), *ARGS, *small, "--run-dir", str(tmp_path / "one")]) == 0
    ref = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)["model"]
    got = _ps(tmp_path, job, "ps", 3, small)["model"]
    for table in TABLES:
        want, have = _by_key(ref, table), _by_key(got, table)
        assert set(want) == set(have) and all(want[k][1:] == have[k][1:] for k in want), table
        assert torch.equal(ref[f"{table}.keymap.stats"], got[f"{table}.keymap.stats"]), table
    assert int(ref["deep.tables.deep_user.keymap.stats"][1]) > 0  # keys aged out


@pytest.mark.parametrize("mode", ["async", "bounded"])
def test_dynamic_tables_on_servers_in_another_mode_are_refused_naming_the_fix(tmp_path, cpu_ranks, mode):
    data, job = _job(tmp_path)
    run = hetero_on_ranks(tmp_path, 3, ["train", "--config", str(job), *ARGS, "--run-dir", str(tmp_path / "ps"),
                                        "--ps-servers", "1", "--ps-mode", mode])
    assert run.returncode == 1, run.stderr[-2000:]
    assert (f"dynamic tables ['wide_user', 'wide_item'] train on parameter servers in sync mode only: a key's row may be "
            f"given to another key between a worker's pull and its push in {mode} mode; use --ps-mode sync") in run.stderr
    assert not (tmp_path / "ps" / "checkpoint.dcp").exists()


@pytest.mark.parametrize("servers", [1, 2, 3, 5])
@pytest.mark.parametrize("first_row", [0, 7])
def test_shard_spans_cover_each_table_row_once_at_the_servers_storage_rows(servers, first_row):
    capacity = 13
    seen = []
    for s in range(servers):
        span = ShardSpan.of(first_row, capacity, s, servers)
        rows = span.table_rows(np.arange(span.rows + 1))
        assert rows[-1] == capacity  # past the map's rows: the table's default row
        for j, i in enumerate(rows[:-1].tolist()):
            assert (first_row + i) % servers == s and (first_row + i) // servers == span.local + j  # plain arithmetic
        seen += rows[:-1].tolist()
    assert sorted(seen) == list(range(capacity))
    keys = np.arange(-500, 500, dtype=np.int64) * 7919
    owners = key_shards(keys, first_row, capacity, servers)
    counts = np.bincount(owners, minlength=servers)
    rows_per_shard = [ShardSpan.of(first_row, capacity, s, servers).rows for s in range(servers)]
    assert all((c > 0) == (r > 0) for c, r in zip(counts, rows_per_shard))  # a shard without rows owns no key


def test_merged_key_maps_put_each_key_at_its_table_row():
    servers, first_row, capacity = 3, 5, 10
    shards = {}
    for s in range(servers):
        span = ShardSpan.of(first_row, capacity, s, servers)
        rows = span.table_rows(np.arange(span.rows))
        shards[f"shard{s}"] = {"step": torch.tensor(9), "table1.row_key": torch.from_numpy(1000 + rows),
                               "table1.row_count": torch.from_numpy(rows.astype(np.int32)),
                               "table1.row_last": torch.full((span.rows,), s, dtype=torch.int32),
                               "table1.sketch": torch.full((4, 64), 2**30, dtype=torch.int32),
                               "table1.next_scan": torch.tensor(s), "table1.stats": torch.tensor([1, 2, 3, span.rows])}
    whole = whole_keymaps(shards, servers, [("a", 0, 5), ("b", first_row, capacity + 1)])
    assert torch.equal(whole["b.keymap.row_key"], torch.arange(1000, 1000 + capacity))
    assert torch.equal(whole["b.keymap.row_count"], torch.arange(capacity, dtype=torch.int32))
    assert whole["b.keymap.row_last"].tolist() == [(first_row + i) % servers for i in range(capacity)]
    assert int(whole["b.keymap.sketch"].max()) == 2**31 - 1 and int(whole["b.keymap.next_scan"]) == 2  # saturated; latest
    assert whole["b.keymap.stats"].tolist() == [3, 6, 9, capacity] and int(whole["b.keymap.step"]) == 9
    assert not any(k.startswith("a.") for k in whole)
