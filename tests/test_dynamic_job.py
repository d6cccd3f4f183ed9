"""Dynamic features in a job file (``dynamic = true`` in the schema): no vocabulary, a row per
admitted value; trained, resumed exactly and predicted by ``hetero``'s commands."""

import random
import shutil

import pytest

from hetero.cli import main
from test_user_data import _last_json, job_file

TRAIN = ["--epochs", "2", "--batch-size", "32", "--no-progress", "--embedding-dim", "4", "--hidden", "8"]

JOB = """[data]
path = "{data}"
{extra}
[schema]
label = "label"
[[schema.categorical]]
column = "user"
dynamic = true
capacity = 24
admit_after = 2
ttl_steps = 6
sketch_width = 1024
[[schema.categorical]]
column = "item"
dynamic = true
capacity = 100
[[schema.dense]]
column = "age"
"""


def _csv(path, n=400, seed=0):
    """label, user, item, age, genres: 60 users (more than the table holds), 20 items, genres bags
    of 0-3 of 6 values (drawn apart, from their own stream; the job here leaves them unread)."""
    rng, bags = random.Random(seed), random.Random(seed + 1000)
    rows = [f"{int((u + i) % 3 == 0)},u{u},{i},{rng.random():.3f},"
            + "|".join(f"g{bags.randint(0, 5)}" for _ in range(bags.randint(0, 3)))
            for u, i in ((rng.randint(0, 59), rng.randint(0, 19)) for _ in range(n))]
    path.write_text("label,user,item,age,genres\n" + "\n".join(rows) + "\n")


@pytest.mark.parametrize("mode", ["memory", "stream", "tinylfu"])  # (tinylfu: in memory, the user feature's on)
def test_a_dynamic_feature_trains_resumes_exactly_and_predicts(tmp_path, capsys, mode):
    on = "sketch_width = 1024\ntinylfu = true\n" if mode == "tinylfu" else "sketch_width = 1024\n"
    template = JOB.replace("sketch_width = 1024\n", on)
    data, job = job_file(tmp_path, template, _csv, stream=mode == "stream")
    runs = {}
    for name, steps in (("straight", []), ("resumed", ["--max-steps", "5"])):
        run = tmp_path / name
        args = ["train", "--config", str(job), *TRAIN, "--run-dir", str(run)]
        args += ["--stream"] if mode == "stream" else []
        if steps:
            assert main([*args, *steps]) == 0
            capsys.readouterr()
            args.append("--resume")
        assert main(args) == 0
        runs[name] = _last_json(capsys)
        assert main(["predict", "--checkpoint", str(run / "checkpoint.pt"), "--data", str(data),
                     "--out", str(tmp_path / f"{name}.csv")]) == 0
    straight, resumed = runs["straight"], runs["resumed"]
    user = straight["dynamic_tables"]["deep.tables.deep_user"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name in ("straight", "resumed"):  # per step in TensorBoard: the steps add up to the run's counts
        events = EventAccumulator(str(tmp_path / name / "tensorboard"))
        events.Reload()
        for key in ("admitted", "evicted", "default_lookups"):
            per_step = events.Scalars(f"dynamic/deep.tables.deep_user/{key}")
            assert len(per_step) == straight["steps"] and sum(e.value for e in per_step) == user[key], (name, key)
        assert events.Scalars("dynamic/deep.tables.deep_user/rows")[-1].value == user["rows"]
    assert user["rows"] <= 24 and user["evicted"] > 0 and user["default_lookups"] > 0  # capped, evicting, admitting
    assert straight["dynamic_tables"] == resumed["dynamic_tables"]
    assert (straight["test_logloss"], straight["test_auc"]) == (resumed["test_logloss"], resumed["test_auc"])
    assert (tmp_path / "straight.csv").read_text() == (tmp_path / "resumed.csv").read_text()
    scores = (tmp_path / "straight.csv").read_text().splitlines()
    assert len(scores) == 401 and len(set(scores[1:])) > 20  # keys read their own rows, not one default row
    import torch  # the job file's sketch width (16 KiB a table, not the default 16 MiB), kept in the checkpoint

    model = torch.load(tmp_path / "straight" / "checkpoint.pt", map_location="cpu")["model"]
    assert model["deep.tables.deep_user.keymap.sketch"].shape == (4, 1024)


def test_a_dynamic_feature_without_a_capacity_takes_the_stated_default(tmp_path, capsys):
    from hetero.data.schema import DEFAULT_CAPACITY

    data, job = job_file(tmp_path, JOB.replace("capacity = 24\n", ""), _csv)
    assert main(["train", "--config", str(job), *TRAIN, "--run-dir", str(tmp_path / "run")]) == 0
    import torch

    model = torch.load(tmp_path / "run" / "checkpoint.pt", map_location="cpu")["model"]
    assert model["deep.tables.deep_user.weight"].shape[0] == DEFAULT_CAPACITY + 1 == 2**20 + 1  # (and the default row)


@pytest.mark.parametrize("line, bad, named", [("capacity = 24", "capacity = 0", "capacity"),
                                               ("admit_after = 2", "admit_after = 0", "admit_after"),
                                               ("sketch_width = 1024", "sketch_width = 1000", "sketch_width"),
                                               ("ttl_steps = 6", "ttl_steps = 6\nhash_buckets = 8", "hash_buckets")])
def test_bad_dynamic_settings_are_refused_naming_the_feature(tmp_path, capsys, line, bad, named):
    data = tmp_path / "ids.csv"
    _csv(data, 50)
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(data=data, extra="").replace(line, bad))
    assert main(["train", "--config", str(job), *TRAIN, "--run-dir", str(tmp_path / "run")]) != 0
    err = capsys.readouterr().err
    assert "'user'" in err and named in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_dynamic_features_keys_are_the_unreduced_fnv1a_hash_of_its_text():
    import numpy as np
    import pyarrow as pa

    from hetero.data.encode import hash_rows

    def fnv1a64(text: str) -> int:  # plain Python, as the schema documents it
        h = 0xCBF29CE484222325
        for b in text.encode():
            h = ((h ^ b) * 0x100000001B3) % 2**64
        return h - 2**64 if h >= 2**63 else h  # as int64

    values = ["u1", "", None, "héllo", "42", "a" * 40]
    keys = hash_rows(pa.array(values, pa.string()), 0).tolist()
    assert keys == [fnv1a64(v) if v else 0 for v in values]
    assert any(k < 0 for k in keys)  # the top bit wraps to a negative int64, no overflow error
    assert hash_rows(pa.array(["42"]), 0).tolist() == hash_rows(pa.array([b"42"], pa.binary()), 0).tolist()
    assert np.array_equal(hash_rows(pa.array(values, pa.string()), 7).numpy(),  # the bucketed mode is unchanged
                          [1 + (fnv1a64(v) % 2**64) % 6 if v else 0 for v in values])


def test_a_dynamic_feature_of_float_values_is_refused_naming_the_column(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    users = [float(i % 7) for i in range(40)]
    users[23] = 2.5
    pq.write_table(pa.table({"label": [0, 1] * 20, "user": users, "item": list(range(40)), "age": [0.5] * 40}),
                   tmp_path / "d.parquet")
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(data=tmp_path / "d.parquet", extra='format = "parquet"'))
    assert main(["train", "--config", str(job), *TRAIN, "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "'user'" in err and "2.5" in err and len(err.strip().splitlines()) == 1
    # whole numbers stored as floats (a column with nulls, as pandas writes ids) are ids
    pq.write_table(pa.table({"label": [0, 1] * 20, "user": [float(i % 7) for i in range(40)], "item": list(range(40)),
                             "age": [0.5] * 40}), tmp_path / "d.parquet")
    assert main(["train", "--config", str(job), *TRAIN, "--run-dir", str(tmp_path / "run2")]) == 0


def test_dynamic_features_train_data_parallel_and_resume_at_another_world_size(tmp_path, cpu_ranks):
    """2 ranks (every rank admits every rank's keys: the replicas stay equal), checkpointed at
    step 5, resumed in one process: the model and key maps equal the 2-rank run's own finish, key
    by key, to rounding (batches of 16: fewer keys than rows in a step, so no step's admissions
    depend on the keys' order, the ranks' or the batch's)."""
    import torch

    from conftest import hetero_on_ranks
    from test_distributed import _by_key

    data = tmp_path / "ids.csv"
    _csv(data)
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(data=data, extra=""))
    args = ["train", "--config", str(job), *TRAIN, "--batch-size", "16", "--dropout", "0"]
    for name, steps in (("two", []), ("split", ["--max-steps", "5"])):
        run = hetero_on_ranks(tmp_path, 2, [*args, "--run-dir", str(tmp_path / name), *steps])
        assert run.returncode == 0, run.stderr[-2000:]
    assert main([*args, "--run-dir", str(tmp_path / "split"), "--resume"]) == 0
    a, b = (torch.load(tmp_path / name / "checkpoint.pt", map_location="cpu") for name in ("two", "split"))
    assert a["position"] == b["position"]
    assert int(a["model"]["deep.tables.deep_user.keymap.stats"][1]) > 0  # evicting
    a, b = _by_key(a["model"]), _by_key(b["model"])
    for k in a:  # 2 ranks' gradients summed against 1 process's: rounding apart
        assert torch.allclose(a[k].double(), b[k].double(), atol=1e-5, rtol=0), k


def _runs_on_ranks(tmp_path, job_text, plan):
    """``hetero train`` of ``job_text`` row-sharded, run by run: ``plan`` is ``(name, ranks, extra args)``
    (ranks 1: in this process, replicated; ranks 0: a copy of the run directory named by the one
    extra arg, as it is then); the runs' checkpoints by name, tables in key order."""
    import torch

    from conftest import hetero_on_ranks
    from test_distributed import _by_key

    job = tmp_path / "job.toml"
    job.write_text(job_text)
    args = ["train", "--config", str(job), *TRAIN, "--batch-size", "16", "--dropout", "0"]
    for name, ranks, extra in plan:
        argv = [*args, "--run-dir", str(tmp_path / name), *extra]
        if ranks == 0:  # (the same first half again would be the same files: copied, not rerun)
            shutil.copytree(tmp_path / extra[0], tmp_path / name)
        elif ranks == 1:
            assert main(argv) == 0
        else:
            run = hetero_on_ranks(tmp_path, ranks, [*argv, "--table-sharding", "row"])
            assert run.returncode == 0, run.stderr[-3000:]
    out = {}
    for name in dict.fromkeys(p[0] for p in plan):
        state = torch.load(tmp_path / name / "checkpoint.pt", map_location="cpu")
        out[name] = (state["position"], state["model"], _by_key(dict(state["model"])))
    return out


def test_row_sharded_dynamic_features_resume_exactly_at_their_world_size(tmp_path, cpu_ranks):
    """Row-sharded over 2 ranks (each rank admits, counts and evicts the keys it owns: the user table
    of 24 rows for 60 users evicts, by LFU within each rank's 12), checkpointed at step 5 and
    resumed at 2 ranks: the model, the key maps (row by row) and the counts equal the straight
    run's, from the integrated and from the sharded (DCP) checkpoint format."""
    import torch

    data = tmp_path / "ids.csv"
    _csv(data)
    runs = _runs_on_ranks(tmp_path, JOB.format(data=data, extra=""),
                          [("two", 2, []), ("split", 2, ["--max-steps", "5"]), ("split", 2, ["--resume"])])
    (pa, a, _), (pb, b, _) = runs["two"], runs["split"]
    assert pa == pb
    assert int(a["deep.tables.deep_user.keymap.stats"][1]) > 0  # evicting
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the sharded (DCP) format: each rank writes its part of the maps; resumed at 2 ranks it equals the
    # straight run, merged it equals the integrated checkpoint; at 4 ranks it is refused naming the fix
    from conftest import hetero_on_ranks
    from hetero.cli import merge

    argv = ["train", "--config", str(tmp_path / "job.toml"), *TRAIN, "--batch-size", "16", "--dropout", "0",
            "--run-dir", str(tmp_path / "dcp"), "--table-sharding", "row", "--checkpoint-format", "sharded"]
    for extra in (["--max-steps", "5"], ["--resume"]):
        run = hetero_on_ranks(tmp_path, 2, [*argv, *extra])
        assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(merge(tmp_path / "dcp" / "checkpoint.dcp", tmp_path / "dcp.pt"), weights_only=False)
    assert got["position"] == pa and got["model"].keys() == a.keys()
    for k in a:
        assert torch.equal(a[k], got["model"][k]), k
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "dcp" / "checkpoint.dcp").iterdir())
    run = hetero_on_ranks(tmp_path, 4, [*argv, "--resume", "--epochs", "3"])
    assert run.returncode == 1 and "row-sharded over [2] ranks, this run shards them over [4]" in run.stderr, run.stderr[-2000:]
    assert "hetero checkpoint merge" in run.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "dcp" / "checkpoint.dcp").iterdir()) == before


def test_row_sharded_dynamic_features_resume_at_another_world_size(tmp_path, cpu_ranks):
    """Row-sharded over 2 ranks, checkpointed at step 5 and resumed in one process and over 4 ranks
    (its keys move to their owners there, with their values and optimizer state): the model and
    the key maps equal the 2-rank run's own finish key by key, to rounding. (Tables with a row
    for every key, so no eviction depends on how rows are shared out; the age scan's does not.)"""
    import torch

    data = tmp_path / "ids.csv"
    _csv(data)
    text = JOB.format(data=data, extra="").replace("capacity = 24", "capacity = 64")
    runs = _runs_on_ranks(tmp_path, text, [("two", 2, []), ("one", 2, ["--max-steps", "5"]), ("four", 0, ["one"]),
                                           ("one", 1, ["--resume"]), ("four", 4, ["--resume"])])
    pa, _, a = runs["two"]
    assert int(runs["two"][1]["deep.tables.deep_user.keymap.stats"][1]) > 0  # evicting by age
    for name in ("one", "four"):
        pb, _, b = runs[name]
        assert pa == pb, name
        for k in a:
            assert torch.allclose(a[k].double(), b[k].double(), atol=1e-5, rtol=0), (name, k)


def test_dynamic_features_on_the_ssd_tier_train_resume_and_predict_as_in_memory(tmp_path, capsys):
    """The job's dynamic tables on the SSD tier under a cache of 0.004 MB (every step writes back
    and reads again), straight and stopped at step 5 and resumed: the checkpoints (the tier's
    snapshots read back) and the predictions equal the run in memory, tensor for tensor."""
    import torch

    from test_ssd_tier import load_whole

    data = tmp_path / "ids.csv"
    _csv(data)
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(data=data, extra=""))
    args = ["train", "--config", str(job), *TRAIN]
    ssd = ["--table-storage", "ssd", "--cache-mb", "0.004"]
    for name, extra in (("memory", []), ("ssd", ssd), ("split", [*ssd, "--max-steps", "5"]),
                        ("split", [*ssd, "--resume"])):
        assert main([*args, "--run-dir", str(tmp_path / name), *extra]) == 0, name
    capsys.readouterr()
    memory = torch.load(tmp_path / "memory" / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert int(memory["model"]["deep.tables.deep_user.keymap.stats"][1]) > 0  # evicting
    tier = torch.load(tmp_path / "ssd" / "checkpoint.pt", map_location="cpu", weights_only=False)["tier"]
    tables = dict(t for g in tier["groups"].values() for t in g["tables"])
    assert tables["deep.tables.deep_user"] == 25 and "tier" not in memory  # (capacity and the default row, on the tier)
    for name in ("ssd", "split"):
        got = load_whole(tmp_path / name / "checkpoint.pt")
        assert got["position"] == memory["position"], name
        for k, v in memory["model"].items():
            assert torch.equal(v, got["model"][k]), (name, k)
        for o, state in memory["sparse_optimizers"].items():
            for t, fields in state["state"].items():
                for f, v in fields.items():
                    assert torch.equal(v, got["sparse_optimizers"][o]["state"][t][f]), (name, t, f)
    scores = {}
    for name in ("memory", "split"):
        out = tmp_path / f"{name}.csv"
        assert main(["predict", "--checkpoint", str(tmp_path / name / "checkpoint.pt"), "--data", str(data),
                     "--out", str(out)]) == 0
        scores[name] = out.read_text()
    assert scores["memory"] == scores["split"]


def test_row_sharded_dynamic_features_on_the_ssd_tier_resume_at_their_world_size_only(tmp_path, cpu_ranks):
    """Row-sharded over 2 ranks, each rank's part on its own tier: stopped at step 5 and resumed at
    2 ranks, the run equals the same run in memory, tensor for tensor; a resume at 4 ranks (whose
    owners would take other rows) is refused naming the world size, before anything is written; in one process it resumes as in memory."""
    import torch

    from conftest import hetero_on_ranks
    from test_ssd_tier import load_whole

    data = tmp_path / "ids.csv"
    _csv(data)
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(data=data, extra=""))
    args = ["train", "--config", str(job), *TRAIN, "--batch-size", "16", "--dropout", "0", "--table-sharding", "row"]
    ssd = ["--table-storage", "ssd", "--cache-mb", "0.004"]
    for name, extra in (("memory", []), ("ssd", [*ssd, "--max-steps", "5"]), ("ssd", [*ssd, "--resume"])):
        if extra[-1:] == ["--resume"]:
            shutil.copytree(tmp_path / name, tmp_path / "ssd_half")  # (for the resume in one process, below)
        run = hetero_on_ranks(tmp_path, 2, [*args, "--run-dir", str(tmp_path / name), *extra])
        assert run.returncode == 0, run.stderr[-3000:]
    memory, got = load_whole(tmp_path / "memory" / "checkpoint.pt"), load_whole(tmp_path / "ssd" / "checkpoint.pt")
    assert int(memory["model"]["deep.tables.deep_user.keymap.stats"][1]) > 0 and memory["position"] == got["position"]
    for k, v in memory["model"].items():
        assert torch.equal(v, got["model"][k]), k
    before = (tmp_path / "ssd" / "checkpoint.pt").read_bytes()
    run = hetero_on_ranks(tmp_path, 4, [*args, "--run-dir", str(tmp_path / "ssd"), *ssd, "--resume", "--epochs", "3"])
    assert run.returncode == 1 and "resume them row-sharded at 2 ranks" in run.stderr, run.stderr[-2000:]
    assert (tmp_path / "ssd" / "checkpoint.pt").read_bytes() == before
    ends = []  # and in one process (the keys keep their rows: the ranks' spans are the table's rows in order)
    for name, extra in (("memory_one", []), ("ssd_one", ssd)):
        if name == "ssd_one":  # (its first half is the "ssd" run's, stopped at step 5: copied, not rerun)
            shutil.copytree(tmp_path / "ssd_half", tmp_path / name)
        else:
            run = hetero_on_ranks(tmp_path, 2, [*args, "--run-dir", str(tmp_path / name), *extra, "--max-steps", "5"])
            assert run.returncode == 0, run.stderr[-3000:]
        assert main([*args, "--run-dir", str(tmp_path / name), *extra, "--resume"]) == 0
        ends.append(load_whole(tmp_path / name / "checkpoint.pt"))
    assert ends[0]["position"] == ends[1]["position"] == memory["position"]
    for k, v in ends[0]["model"].items():
        assert torch.equal(v, ends[1]["model"][k]), k


def test_dynamic_features_train_with_prefetch_as_without(tmp_path, caplog):
    """``--prefetch``: the dynamic tables are looked up at their step (said once a run), the run equals the
    run without prefetch tensor for tensor."""
    import torch

    data = tmp_path / "ids.csv"
    _csv(data)
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(data=data, extra=""))
    for name, extra in (("plain", []), ("prefetch", ["--prefetch"])):
        with caplog.at_level("INFO", logger="hetero"):
            assert main(["train", "--config", str(job), *TRAIN, "--run-dir", str(tmp_path / name), *extra]) == 0
    assert caplog.text.count("are looked up at their step") == 1
    assert "dynamic tables ['wide_user', 'wide_item', 'deep_user', 'deep_item'] are looked up at their step" in caplog.text
    a, b = (torch.load(tmp_path / n / "checkpoint.pt", weights_only=False)["model"] for n in ("plain", "prefetch"))
    assert int(a["deep.tables.deep_user.keymap.stats"][1]) > 0 and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_dynamic_feature_resumes_exactly_from_the_sharded_checkpoint_format(tmp_path, cpu_ranks, ranks):
    """``--checkpoint-format sharded`` (DCP), in one process and replicated over 2 ranks: stopped at step 5
    and resumed, the run equals the straight one tensor for tensor, key maps included (a load in place
    once reached only copies of the maps: the resumed run started with empty ones)."""
    import torch

    from conftest import hetero_on_ranks
    from hetero.cli import merge

    data, job = job_file(tmp_path, JOB, _csv)
    args = ["train", "--config", str(job), *TRAIN, "--dropout", "0", "--checkpoint-format", "sharded"]
    for name, extra in (("straight", []), ("split", ["--max-steps", "5"]), ("split", ["--resume"])):
        argv = [*args, "--run-dir", str(tmp_path / name), *extra]
        if ranks == 0:  # (the same first half again would be the same files: copied, not rerun)
            shutil.copytree(tmp_path / extra[0], tmp_path / name)
        elif ranks == 1:
            assert main(argv) == 0
        else:
            run = hetero_on_ranks(tmp_path, ranks, argv)
            assert run.returncode == 0, run.stderr[-3000:]
    a, b = (torch.load(merge(tmp_path / n / "checkpoint.dcp", tmp_path / f"{n}.pt"), weights_only=False)
            for n in ("straight", "split"))
    assert int(a["model"]["deep.tables.deep_user.keymap.stats"][1]) > 0  # evicting
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert torch.equal(a["losses"], b["losses"])
