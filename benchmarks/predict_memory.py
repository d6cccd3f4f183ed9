"""``hetero predict``'s resident memory against the rows it scores (issue #74.12): a small run
scores a CSV of ``--rows`` rows (with 64-bit ids as its id column) block by block; the resident
set (``VmRSS``) is sampled after each written block. Flat in the row count: the growth after the
first quarter of the blocks stays at the allocators' noise (the predict before #74 kept every
score, label and id: +106 MiB per 1.75M rows).

    python benchmarks/predict_memory.py --rows 2000000 4000000
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu, emit  # noqa: E402

import hetero.predict as predict  # noqa: E402
from hetero.cli import main as hetero  # noqa: E402

JOB = """[data]
path = "{data}"
[schema]
label = "y"
[[schema.categorical]]
column = "city"
[[schema.dense]]
column = "age"
"""


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def measure(directory: Path, rows: int) -> dict:
    rng = np.random.default_rng(0)
    block = "".join(f"{10000174058809263569 + i},{int(rng.random() < 0.3)},c{rng.integers(0, 20)},{rng.integers(18, 70)}\n"
                    for i in range(1000))
    with open(directory / "big.csv", "w") as f:
        f.write("id,y,city,age\n")
        for _ in range(rows // 1000):
            f.write(block)
    seen, write = [], predict.ScoreWriter.write

    def sampled(self, table) -> None:  # noqa: ANN001 - a pyarrow Table
        write(self, table)
        seen.append(_rss_kib())

    predict.ScoreWriter.write = sampled
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            assert hetero(["predict", "--checkpoint", str(directory / "run" / "checkpoint.pt"), "--data",
                           str(directory / "big.csv"), "--out", str(directory / "s.parquet"), "--id-column", "id"]) == 0
    finally:
        predict.ScoreWriter.write = write
    warm = max(seen[: max(len(seen) // 4, 1)])
    return {"rows": rows, "blocks": len(seen), "rss_warm_mib": warm / 1024, "rss_max_mib": max(seen) / 1024,
            "rss_last_mib": seen[-1] / 1024, "growth_after_warmup_mib": (max(seen) - warm) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2_000_000, 4_000_000])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        rng = np.random.default_rng(1)
        (directory / "train.csv").write_text("id,y,city,age\n" + "".join(
            f"{i},{int(rng.random() < 0.3)},c{rng.integers(0, 20)},{rng.integers(18, 70)}\n" for i in range(2000)))
        (directory / "job.toml").write_text(JOB.format(data=directory / "train.csv"))
        with contextlib.redirect_stdout(io.StringIO()):
            assert hetero(["train", "--config", str(directory / "job.toml"), "--epochs", "1", "--no-progress",
                           "--run-dir", str(directory / "run")]) == 0
        runs = [measure(directory, n) for n in args.rows]
    emit(f"predict_memory_{cpu()['tag']}", {"runs": runs, "max_growth_after_warmup_mib":
                                          max(r["growth_after_warmup_mib"] for r in runs)})


if __name__ == "__main__":
    main()
