"""Compute threads on this host (issue #74.16): the same ``hetero train`` job (a generated CTR
file, Wide & Deep, 2 epochs) with ``--threads 1`` and with torch's own count, each in a fresh
process, on an idle host and with every other core kept busy by a spinning process; samples/s
of each, and their ratios. What ``hetero.placement.threads.default_compute_threads`` stands on.

    python benchmarks/threads.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu, emit  # noqa: E402

JOB = """[data]
path = "{data}"
[schema]
label = "y"
[[schema.categorical]]
column = "user"
[[schema.categorical]]
column = "item"
[[schema.dense]]
column = "age"
"""


def _train(directory: Path, threads: int, name: str) -> float:
    done = subprocess.run([sys.executable, "-m", "hetero", "train", "--config", str(directory / "job.toml"),
                           "--epochs", "2", "--patience", "0", "--no-progress", "--threads", str(threads),
                           "--run-dir", str(directory / name)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["samples_per_s"]


def main() -> None:
    many = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        directory, rng = Path(tmp), np.random.default_rng(0)
        users, items = rng.integers(0, 900, 60_000), rng.integers(0, 1600, 60_000)
        y = (rng.random(60_000) < 0.2 + 0.5 * ((users % 7) < 3)).astype(int)
        (directory / "d.csv").write_text("y,user,item,age\n" + "".join(
            f"{a},u{b},i{c},{d}\n" for a, b, c, d in zip(y, users, items, rng.integers(18, 70, 60_000))))
        (directory / "job.toml").write_text(JOB.format(data=directory / "d.csv"))
        out = {"threads_default": many}
        for load in ("idle", "busy"):
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range(max(os.cpu_count() - 1, 1))] if load == "busy" else []
            try:
                out[load] = {f"threads_{n}": _train(directory, n, f"{load}_{n}") for n in (1, many)}
            finally:
                for s in spinners:
                    s.kill()
            out[load]["one_over_default"] = out[load]["threads_1"] / out[load][f"threads_{many}"]
    emit(f"threads_{cpu()['tag']}", out)


if __name__ == "__main__":
    main()
