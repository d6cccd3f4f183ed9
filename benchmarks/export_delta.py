"""Export and delta (issue #38): a run with a dynamic feature of about ``--keys`` distinct values,
checkpointed after one epoch and after two (every row the second epoch touched changes); the
seconds ``hetero export`` takes for the full export and for the delta between the two
checkpoints, the rows the delta holds and its size on disk, and the seconds to apply it.

    python benchmarks/export_delta.py --keys 1000000
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

from hetero.cli import main as hetero  # noqa: E402
from hetero.serving import apply_delta, read_manifest  # noqa: E402

JOB = """[data]
path = "{data}"
split = [0.98, 0.01, 0.01]
[schema]
label = "label"
[[schema.categorical]]
column = "user"
dynamic = true
capacity = {capacity}
role = "deep"
[[schema.dense]]
column = "x"
"""


def quiet(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = hetero(argv)
    assert code == 0, argv
    return json.loads(out.getvalue().strip().splitlines()[-1])


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, default=1_000_000, help="distinct values of the dynamic feature (about)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--dir", default=None, help="where the run and the exports go (default: the temp dir)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        d = Path(d)
        rng = np.random.default_rng(0)
        n = int(args.keys * 1.6)  # draws of a uniform key space of --keys * 2: about --keys distinct values
        users = rng.integers(0, 2 * args.keys, n)
        labels = (rng.random(n) < 0.3).astype(np.int64)
        with open(d / "data.csv", "w") as f:
            f.write("label,user,x\n")
            f.writelines(f"{y},u{u},{x:.3f}\n" for y, u, x in zip(labels, users, rng.random(n)))
        (d / "job.toml").write_text(JOB.format(data=d / "data.csv", capacity=2 * args.keys))
        train = ["train", "--config", str(d / "job.toml"), "--batch-size", "4096", "--no-progress", "--embedding-dim",
                 str(args.dim), "--hidden", "16", "--run-dir", str(d / "run")]
        quiet([*train, "--epochs", "1"])
        (d / "old.pt").write_bytes((d / "run" / "checkpoint.pt").read_bytes())
        quiet([*train, "--epochs", "2", "--resume"])
        t0 = time.perf_counter()
        quiet(["export", "--checkpoint", str(d / "run" / "checkpoint.pt"), "--out", str(d / "full")])
        full_s = time.perf_counter() - t0
        quiet(["export", "--checkpoint", str(d / "old.pt"), "--out", str(d / "old")])
        t0 = time.perf_counter()
        got = quiet(["export", "--checkpoint", str(d / "run" / "checkpoint.pt"), "--out", str(d / "delta"),
                     "--since", str(d / "old.pt")])
        delta_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        apply_delta(d / "old", d / "delta", d / "applied")
        apply_s = time.perf_counter() - t0
        table = read_manifest(d / "full")["tables"]["deep.tables.deep_user"]
        result = {"keys_held": table["rows"], "dim": args.dim, "data_rows": n,
                  "full_export_s": full_s, "full_export_bytes": size(d / "full"),
                  "delta_export_s": delta_s, "delta_rows": got["rows"], "delta_tombstones": got["tombstones"],
                  "delta_bytes": size(d / "delta"), "apply_delta_s": apply_s,
                  "checkpoint_bytes": (d / "run" / "checkpoint.pt").stat().st_size}
    emit("export_delta", result)


if __name__ == "__main__":
    main()
