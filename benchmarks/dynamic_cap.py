"""Quality at a cap (issue #38): the Criteo job with every categorical feature dynamic
(``dynamic = true``, LFU eviction), each table capped at a share of its column's distinct values,
against the same job uncapped (capacity = the distinct values); test AUC against the cap, mean
over ``--seeds`` seeds (each seed splits, shuffles and initialises anew), and a plot.

    python benchmarks/dynamic_cap.py --data ../shared/data/criteo_kaggle_first8k.tsv
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, emit  # noqa: E402

from hetero.cli import main as hetero  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]


def distinct_values(path: Path) -> list[int]:
    """Distinct non-empty values of C1..C26 over the file (an upper bound of the training split's)."""
    seen: list[set[str]] = [set() for _ in range(26)]
    with open(path) as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            for j, v in enumerate(fields[14:40]):
                if v:
                    seen[j].add(v)
    return [len(s) for s in seen]


def job_text(capacities: list[int] | None) -> str:
    """The example Criteo job with dynamic categorical features of these capacities (``None``:
    the example's hashed features)."""
    text = (ROOT / "examples" / "criteo.toml").read_text()
    head = text[: text.index("[[schema.categorical]]")]
    if capacities is None:
        return text
    cats = "".join(f'[[schema.categorical]]\ncolumn = "C{i + 1}"\ndynamic = true\ncapacity = {c}\neviction = "lfu"\n\n'
                   for i, c in enumerate(capacities))
    return head + cats


def test_auc(job: str, data: Path, seed: int, epochs: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "job.toml"
        path.write_text(job)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = hetero(["train", "--config", str(path), "--data-path", str(data), "--epochs", str(epochs),
                           "--seed", str(seed), "--no-progress", "--run-dir", str(Path(d) / "run")])
        assert code == 0, out.getvalue()[-2000:]
        return float(json.loads(out.getvalue().strip().splitlines()[-1])["test_auc"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "criteo_kaggle_first8k.tsv")
    p.add_argument("--caps", default="1.0,0.75,0.5,0.25,0.1", help="shares of each column's distinct values")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    distinct = distinct_values(args.data)
    caps = [float(c) for c in args.caps.split(",")]
    seeds = range(args.seeds)
    result: dict = {"data": args.data.name, "distinct_values": distinct, "epochs": args.epochs, "seeds": args.seeds,
                    "eviction": "lfu", "admit_after": 1}
    hashed = [test_auc(job_text(None), args.data, s, args.epochs) for s in seeds]
    result["hashed_2pow18_auc"] = float(np.mean(hashed))
    by_cap = {}
    for cap in caps:
        capacities = [max(1, math.ceil(cap * n)) for n in distinct]
        aucs = [test_auc(job_text(capacities), args.data, s, args.epochs) for s in seeds]
        by_cap[str(cap)] = {"auc_mean": float(np.mean(aucs)), "aucs": aucs, "rows": sum(capacities)}
        print(f"cap {cap:5.2f}: test AUC {np.mean(aucs):.4f} ({', '.join(f'{a:.4f}' for a in aucs)})", file=sys.stderr)
    result["by_cap"] = by_cap
    full = by_cap[str(max(caps))]["auc_mean"]
    result["auc_drop_at_half"] = full - by_cap["0.5"]["auc_mean"] if "0.5" in by_cap else None
    result["auc_drop_at_half_per_seed"] = ([a - b for a, b in zip(by_cap[str(max(caps))]["aucs"], by_cap["0.5"]["aucs"])]
                                           if "0.5" in by_cap else None)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(caps, [by_cap[str(c)]["auc_mean"] for c in caps], "o-", label="dynamic, LFU")
    ax.axhline(result["hashed_2pow18_auc"], color="gray", ls="--", label="hashed, 2^18 rows")
    ax.set_xlabel("capacity / distinct values")
    ax.set_ylabel(f"test AUC (mean of {args.seeds} seeds)")
    ax.set_title(f"{args.data.stem}: AUC against the cap", fontsize=10)
    ax.legend()
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / "dynamic_cap_cpu.png", dpi=100)
    result["plot"] = "dynamic_cap_cpu.png"
    emit("dynamic_cap", result)


if __name__ == "__main__":
    main()
