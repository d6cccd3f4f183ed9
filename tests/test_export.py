"""``hetero export``: a run's model as a torch.export program and Parquet tables, deltas between
checkpoints, and an export scoring as its checkpoint does (``hetero predict``)."""

import json
import shutil

import numpy as np
import pyarrow.csv as pacsv
import pytest

from hetero.cli import main
from hetero.serving import apply_delta, read_manifest
from hetero.serving.tables import read_table, read_values
from test_dynamic_job import _csv  # (label, user, item, age, genres)

JOB = """[data]
path = "{data}"
[schema]
label = "label"
[[schema.categorical]]
column = "user"
dynamic = true
capacity = 24
admit_after = 2
[[schema.categorical]]
column = "item"
hash_buckets = 50
[[schema.categorical]]
column = "genres"
separator = "|"
dynamic = true
capacity = 10
[[schema.dense]]
column = "age"
"""


def _scores(path):
    return pacsv.read_csv(path).column("score").to_numpy()


@pytest.fixture(params=["wide_deep", "dlrm", "wide_deep_ssd"])
def checkpoints(tmp_path_factory, request):
    """An older (step 5) and a newer (end of training) checkpoint of one run (``_ssd``: its tables on
    the SSD tier under a cache of 0.004 MB; the run directory copied at step 5 keeps the older
    checkpoint's tier snapshots, which the newer save removes from the run's)."""
    tmp = tmp_path_factory.mktemp(request.param)
    _csv(tmp / "data.csv")
    (tmp / "job.toml").write_text(JOB.format(data=tmp / "data.csv"))
    args = ["train", "--config", str(tmp / "job.toml"), "--epochs", "2", "--batch-size", "32", "--no-progress",
            "--embedding-dim", "4", "--hidden", "8", "--model", request.param.removesuffix("_ssd"),
            "--run-dir", str(tmp / "run")]
    args += ["--table-storage", "ssd", "--cache-mb", "0.004"] if request.param.endswith("_ssd") else []
    assert main([*args, "--max-steps", "5"]) == 0
    shutil.copytree(tmp / "run", tmp / "run_at_5")
    assert main([*args, "--resume"]) == 0
    return tmp, tmp / "run_at_5" / "checkpoint.pt", tmp / "run" / "checkpoint.pt"


def test_an_export_scores_as_its_checkpoint_and_a_delta_makes_the_newer_export(checkpoints, capsys):
    tmp, old, new = checkpoints
    data = tmp / "data.csv"
    for name, ckpt, since in (("old", old, None), ("new", new, None), ("delta", new, old)):
        assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp / name),
                     *(["--since", str(since)] if since else [])]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["kind"] == "delta" and got["tombstones"] > 0  # users evicted between the two checkpoints
    full, delta = read_manifest(tmp / "new"), read_manifest(tmp / "delta")
    user = delta["tables"]["deep.tables.deep_user"]
    assert 0 < user["changed"] and user["rows"] == full["tables"]["deep.tables.deep_user"]["rows"] <= 24
    apply_delta(tmp / "old", tmp / "delta", tmp / "applied")
    for name in full["tables"]:  # the delta applied to the older export is the newer export, bit for bit
        a, b = (read_table(tmp / d / "tables" / f"{name}.parquet") for d in ("new", "applied"))
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), name
    assert read_manifest(tmp / "applied")["tables"] == full["tables"]
    # the round trip: the export scores the file as the checkpoint does
    for source, out in ((new, "ckpt.csv"), (tmp / "new", "export.csv"), (tmp / "applied", "applied.csv")):
        assert main(["predict", "--checkpoint", str(source), "--data", str(data), "--out", str(tmp / out)]) == 0
    assert np.allclose(_scores(tmp / "export.csv"), _scores(tmp / "ckpt.csv"), atol=1e-6, rtol=0)
    assert np.array_equal(_scores(tmp / "applied.csv"), _scores(tmp / "export.csv"))
    assert np.std(_scores(tmp / "export.csv")) > 0


def test_exports_refuse_what_they_cannot_do_naming_it(checkpoints, capsys):
    tmp, old, new = checkpoints
    assert main(["export", "--checkpoint", str(new), "--out", str(tmp / "e")]) == 0
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(new), "--out", str(tmp / "e")]) == 1  # an existing directory
    assert "exists" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(new), "--out", str(tmp / "d"), "--since", str(old)]) == 0
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(tmp / "d"), "--data", str(tmp / "data.csv"),
                 "--out", str(tmp / "s.csv")]) == 1
    assert "delta" in capsys.readouterr().err
    with pytest.raises(ValueError, match="does not apply"):
        apply_delta(tmp / "d", tmp / "e", tmp / "x")  # arguments swapped
    assert not (tmp / "x").exists()
    if (tmp / "run" / "ssd").exists():  # an SSD run's checkpoint file without its tier snapshots (moved away alone)
        shutil.copy(old, tmp / "alone.pt")
        assert main(["export", "--checkpoint", str(tmp / "alone.pt"), "--out", str(tmp / "a")]) == 1
        err = capsys.readouterr().err
        assert "manifest.json is missing" in err and len(err.strip().splitlines()) == 1 and not (tmp / "a").exists(), err


def test_a_delta_applies_to_its_own_base_only_decided_by_content_never_by_path(tmp_path, capsys, monkeypatch):
    """The docs' rolling ``--since last.pt``: A, B, C are one path at three steps. A B->C delta is
    refused on A's export (the path string matched before), and the valid pair is accepted given
    once as an absolute and once as a relative path (refused before)."""
    _csv(tmp_path / "data.csv")
    (tmp_path / "job.toml").write_text(JOB.format(data=tmp_path / "data.csv"))
    args = ["train", "--config", str(tmp_path / "job.toml"), "--epochs", "2", "--batch-size", "32", "--no-progress",
            "--embedding-dim", "4", "--hidden", "8", "--run-dir", str(tmp_path / "run")]
    last = tmp_path / "last.pt"
    for step, name in ((4, "A"), (8, "B"), (None, "C")):
        assert main([*args, *(["--max-steps", str(step)] if step else []), *(["--resume"] if name != "A" else [])]) == 0
        shutil.copy(tmp_path / "run" / "checkpoint.pt", last)  # the same path at every step
        if name != "C":
            shutil.copy(last, tmp_path / f"{name}.pt")
        since = [] if name == "A" else ["--since", str(tmp_path / f"prev{name}.pt")]
        assert main(["export", "--checkpoint", str(last), "--out", str(tmp_path / name), *since]) == 0
        if name != "C":
            shutil.copy(last, tmp_path / f"prev{chr(ord(name) + 1)}.pt")
    assert main(["export", "--checkpoint", str(tmp_path / "B.pt"), "--out", str(tmp_path / "B_full")]) == 0
    capsys.readouterr()
    a, bc = read_manifest(tmp_path / "A"), read_manifest(tmp_path / "C")  # (their paths: information only)
    assert bc["kind"] == "delta" and bc["base"]["step"] == 8 and bc["source"]["run"] == a["source"]["run"]
    with pytest.raises(ValueError, match="starts from run .* at step 8"):
        apply_delta(tmp_path / "A", tmp_path / "C", tmp_path / "wrong")  # B->C onto A's export
    assert not (tmp_path / "wrong").exists()
    monkeypatch.chdir(tmp_path)
    apply_delta("B_full", tmp_path / "C", "C_full")  # the same valid pair, one relative path and one absolute
    assert main(["export", "--checkpoint", str(last), "--out", str(tmp_path / "C_direct")]) == 0
    for name in read_manifest(tmp_path / "C_direct")["tables"]:
        x, y = (read_table(tmp_path / d / "tables" / f"{name}.parquet") for d in ("C_direct", "C_full"))
        assert np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]), name
    assert read_manifest(tmp_path / "C_full")["source"] == read_manifest(tmp_path / "C_direct")["source"]


class _Marker:
    """A pickle that makes a directory when unpickled: the proof that code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return os.mkdir, (self.path,)


def _crafted(src, dst, change):
    """``src`` (an exported program archive) rewritten entry by entry through ``change(name, bytes)``."""
    import zipfile

    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w") as b:
        for info in a.infolist():
            data = change(info.filename, a.read(info.filename))
            b.writestr(info.filename, data)


def test_no_code_runs_from_a_crafted_export(tmp_path, capsys):
    """A weight marked use_pickle (torch.export.load unpickles it with weights_only=False), a guard
    of Python source and a graph target outside torch.ops: each refused in one line, nothing run."""
    import io

    import torch

    from hetero.serving.program import UnsafeProgramError, load_program

    _csv(tmp_path / "data.csv")
    (tmp_path / "job.toml").write_text(JOB.format(data=tmp_path / "data.csv"))
    assert main(["train", "--config", str(tmp_path / "job.toml"), "--epochs", "1", "--no-progress", "--embedding-dim",
                 "4", "--hidden", "8", "--run-dir", str(tmp_path / "run")]) == 0
    assert main(["export", "--checkpoint", str(tmp_path / "run" / "checkpoint.pt"), "--out", str(tmp_path / "e")]) == 0
    marker = tmp_path / "code_ran"

    def pickled_weight(name, data):
        if name.endswith("model_weights_config.json"):
            doc = json.loads(data)
            doc["config"][next(iter(doc["config"]))]["use_pickle"] = True
            return json.dumps(doc)
        if not name.endswith("/weight_0"):
            return data
        buf = io.BytesIO()
        torch.save(_Marker(marker), buf)  # (torch.save's archive of a pickle that calls os.mkdir when loaded)
        return buf.getvalue()

    def guard(name, data):
        if name.endswith("models/model.json"):
            doc = json.loads(data)
            doc["guards_code"].append(f"__import__('os').mkdir({str(marker)!r})")
            return json.dumps(doc)
        return data

    def target(name, data):
        return data.replace(b'"torch.ops.aten.add.Tensor"', b'"torch.os.system"') if name.endswith("model.json") else data

    _crafted(tmp_path / "e" / "dense.pt2", tmp_path / "pickled.pt2", pickled_weight)
    with pytest.raises(Exception):  # noqa: B017 - the payload is live: torch's own loader runs it (then fails)
        torch.export.load(str(tmp_path / "pickled.pt2"))
    assert marker.is_dir()
    marker.rmdir()
    for name, change in (("pickled", pickled_weight), ("guard", guard), ("target", target)):
        crafted = tmp_path / f"export_{name}"
        shutil.copytree(tmp_path / "e", crafted)
        _crafted(tmp_path / "e" / "dense.pt2", crafted / "dense.pt2", change)
        with pytest.raises(UnsafeProgramError, match="refused"):
            load_program(crafted / "dense.pt2")
        capsys.readouterr()
        assert main(["predict", "--checkpoint", str(crafted), "--data", str(tmp_path / "data.csv"),
                     "--out", str(tmp_path / f"{name}.csv")]) == 1
        err = capsys.readouterr().err.strip()
        assert "refused" in err and len(err.splitlines()) == 1, err
        assert not marker.exists() and not (tmp_path / f"{name}.csv").exists(), name
