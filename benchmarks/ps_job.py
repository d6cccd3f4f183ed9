"""``hetero train --ps-servers 2`` on the Criteo job against the same job without servers (issue
#39, target 3: >= 0.7).

The example Criteo job (``examples/criteo.toml``) on a Criteo TSV (default: the 8,000-row Kaggle
sample), ``--epochs`` epochs of batches of ``--batch-size``, three ways, each a fresh process (or
torchrun job), in ``--rounds`` rounds with the order rotating: without servers (one process, all
cores: how the job runs without ``--ps-servers``), without servers on one thread (what torchrun
gives each process of a job of several, the worker's share here), and with 2 servers + 1 worker
under torchrun (3 processes). The rate is the trainer's own ``samples_per_s`` (training steps
after warm-up; evaluation and checkpoints excluded); the ratios are of medians over the rounds.
Sync mode is checked to reach the same test AUC as the job without servers in every round.

    python benchmarks/ps_job.py --data ../shared/data/criteo_kaggle_first8k.tsv
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu, emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(way: str, data: Path, epochs: int, batch_size: int) -> dict:
    """One training run (``way``: ``local``, ``local_one_thread`` or ``ps``); its final JSON line."""
    with tempfile.TemporaryDirectory() as d:
        args = ["train", "--config", str(ROOT / "examples" / "criteo.toml"), "--data-path", str(data), "--epochs",
                str(epochs), "--batch-size", str(batch_size), "--no-progress", "--run-dir", str(Path(d) / "run")]
        env = dict(os.environ)
        if way == "ps":  # (torchrun gives each of its 3 processes one thread)
            cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "3", "-m", "hetero", *args,
                   "--ps-servers", "2"]
        else:
            cmd = [str(BIN / "hetero"), *args]
            if way == "local_one_thread":
                env["OMP_NUM_THREADS"] = "1"
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "criteo_kaggle_first8k.tsv")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--name", default="ps_job", help="the result's name (results/NAME_cpu.json)")
    args = p.parse_args()
    ways = ["local", "local_one_thread", "ps"]
    rates: dict[str, list[float]] = {w: [] for w in ways}
    aucs: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.rounds):
        for way in ways[r % 3:] + ways[: r % 3]:
            result = run(way, args.data, args.epochs, args.batch_size)
            rates[way].append(result["samples_per_s"])
            aucs[way].append(result["test_auc"])
            print(f"round {r} {way:16s} {result['samples_per_s']:9.0f} samples/s, test AUC {result['test_auc']:.6f}",
                  file=sys.stderr)
    median = {w: statistics.median(v) for w, v in rates.items()}
    emit(args.name, {
        "job": "examples/criteo.toml", "data": args.data.name, "epochs": args.epochs, "batch_size": args.batch_size,
        "servers": 2, "workers": 1, "mode": "sync", "rounds": args.rounds, "cpu": cpu(),
        "samples_per_s": median, "rounds_samples_per_s": rates,
        "ps_over_local": median["ps"] / median["local"],
        "ps_over_local_one_thread": median["ps"] / median["local_one_thread"],
        "target": 0.7, "met": median["ps"] / median["local"] >= 0.7,
        "same_test_auc": all(a == aucs["local"][0] for v in aucs.values() for a in v),
    })


if __name__ == "__main__":
    main()
