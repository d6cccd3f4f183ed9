"""Quality at a cap (issue #38): a job's categorical id features dynamic (``dynamic = true``, LFU
eviction), each table capped at a share of its column's distinct values, against the same job
uncapped (capacity = the distinct values) and the example's fixed vocabulary; test AUC against the
cap, mean over ``--seeds`` seeds (each seed splits, shuffles and initialises anew), and a plot.

* ``--dataset criteo``: the Criteo job (``examples/criteo.toml``), all 26 categorical features
  dynamic, against its hashed features (2^18 buckets).
* ``--dataset movielens``: the demo's MovieLens-100K job (``examples/movielens.toml``, its files
  fetched by ``make demo``), its user and movie ids dynamic (943 and 1682 distinct; the other
  features and the crosses as in the example), against the fitted vocabulary; and, as a reference
  for what a table of half the ids can reach, a fitted vocabulary of the most frequent half of each column
  (``min_count`` set so about half its values get a row; the rest share its trained
  out-of-vocabulary row): it knows every value's count before training and never evicts.

    python benchmarks/dynamic_cap.py --data ../shared/data/criteo_kaggle_first8k.tsv
    python benchmarks/dynamic_cap.py --dataset movielens
    python benchmarks/dynamic_cap.py --dataset movielens --epochs 8 --seeds 8 --caps 1.0,0.5 --tinylfu

``--tinylfu``: the capped tables admit by TinyLFU's filter (``tinylfu = true``:
:class:`hetero.dynamic.DynamicConfig`); the uncapped one never fills, and stays the reference.
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


def job_text(capacities: list[int] | None, extra: str = "") -> str:
    """The example Criteo job with dynamic categorical features of these capacities (``None``:
    the example's hashed features), ``extra`` (job-file lines) added to each."""
    text = (ROOT / "examples" / "criteo.toml").read_text()
    head = text[: text.index("[[schema.categorical]]")]
    if capacities is None:
        return text
    cats = "".join(f'[[schema.categorical]]\ncolumn = "C{i + 1}"\ndynamic = true\ncapacity = {c}\n'
                   f'eviction = "lfu"\n{extra}\n' for i, c in enumerate(capacities))
    return head + cats


def _movielens_with(keys: list[str]) -> str:
    """The demo's MovieLens job with ``keys`` (job-file lines, one string each for the user and the
    movie ids' ``[[schema.categorical]]``) added to those two features."""
    text = (ROOT / "examples" / "movielens.toml").read_text()
    for (column, name), extra in zip((("user_id", "user"), ("item_id", "item")), keys):
        block = f'column = "{column}"\nname = "{name}"\n'
        assert block in text, column
        text = text.replace(block, block + extra)
    return text


def movielens_job(capacities: list[int] | None, extra: str = "") -> str:
    """The demo's MovieLens job with its user and movie ids dynamic at these capacities (``None``:
    the example's fitted vocabulary), ``extra`` (job-file lines) added to both."""
    if capacities is None:
        return _movielens_with(["", ""])
    return _movielens_with([f'dynamic = true\ncapacity = {c}\neviction = "lfu"\n{extra}' for c in capacities])


def frequent_half_job(min_counts: list[int]) -> str:
    """The demo's MovieLens job with its user and movie vocabularies limited to the values seen at
    least ``min_counts`` times in the training split."""
    return _movielens_with([f"min_count = {m}\n" for m in min_counts])


def half_min_counts(directory: Path, train_share: float = 0.8) -> tuple[list[int], list[float]]:
    """Per column (user, movie): the ``min_count`` whose vocabulary holds the share of values
    closest to a half, by each value's count in the file times ``train_share`` (the job's training
    split, random: expected counts), and that share."""
    counts: list[dict[str, int]] = [{}, {}]
    with open(directory / "ml-100k.inter") as f:
        next(f)
        for line in f:
            for c, v in zip(counts, line.split("\t")[:2]):
                c[v] = c.get(v, 0) + 1
    out, shares = [], []
    for c in counts:
        n = np.array(list(c.values())) * train_share
        share = {m: float(np.mean(n >= m)) for m in range(1, int(n.max()) + 1)}
        best = min(share, key=lambda m: abs(share[m] - 0.5))
        out.append(best)
        shares.append(share[best])
    return out, shares


def movielens_distinct(directory: Path) -> list[int]:
    """Distinct users and movies rated in ``ml-100k.inter`` (an upper bound of the training split's)."""
    users, items = set(), set()
    with open(directory / "ml-100k.inter") as f:
        next(f)
        for line in f:
            u, i = line.split("\t")[:2]
            users.add(u)
            items.add(i)
    return [len(users), len(items)]


def test_auc(job: str, data: Path | None, seed: int, epochs: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "job.toml"
        path.write_text(job)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = hetero(["train", "--config", str(path), *(["--data-path", str(data)] if data else []), "--epochs",
                           str(epochs), "--seed", str(seed), "--no-progress", "--run-dir", str(Path(d) / "run")])
        assert code == 0, out.getvalue()[-2000:]
        return float(json.loads(out.getvalue().strip().splitlines()[-1])["test_auc"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", choices=["criteo", "movielens"], default="criteo")
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "criteo_kaggle_first8k.tsv",
                   help="criteo: the TSV file")
    p.add_argument("--movielens-dir", type=Path, default=Path.home() / ".cache" / "hetero" / "movielens-100k",
                   help="movielens: the fetched files (make demo puts them here)")
    p.add_argument("--caps", default="1.0,0.75,0.5,0.25,0.1", help="shares of each column's distinct values")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--tinylfu", action="store_true", help="the capped tables (caps below 1) with TinyLFU admission "
                   "(tinylfu = true); the uncapped one, which never evicts, as it is")
    p.add_argument("--name", default=None, help="the result's name (results/NAME_cpu.json; default: dynamic_cap, "
                   "dynamic_cap_movielens)")
    args = p.parse_args()
    movielens = args.dataset == "movielens"
    distinct = movielens_distinct(args.movielens_dir) if movielens else distinct_values(args.data)
    job, data = (movielens_job, None) if movielens else (job_text, args.data)
    caps = [float(c) for c in args.caps.split(",")]
    seeds = range(args.seeds)
    result: dict = {"data": "movielens-100k" if movielens else args.data.name, "distinct_values": distinct,
                    "epochs": args.epochs, "seeds": args.seeds, "eviction": "lfu", "admit_after": 1,
                    "tinylfu": args.tinylfu}
    fixed = [test_auc(job(None), data, s, args.epochs) for s in seeds]
    result["fitted_vocabulary_auc" if movielens else "hashed_2pow18_auc"] = float(np.mean(fixed))
    if movielens:
        min_counts, shares = half_min_counts(args.movielens_dir)
        half = [test_auc(frequent_half_job(min_counts), None, s, args.epochs) for s in seeds]
        result["frequent_half_vocabulary"] = {"min_count": min_counts, "share_held": shares,
                                              "auc_mean": float(np.mean(half)), "aucs": half,
                                              "auc_drop": float(np.mean(fixed)) - float(np.mean(half))}
        print(f"frequent half: test AUC {np.mean(half):.4f}", file=sys.stderr)
    by_cap = {}
    for cap in caps:
        capacities = [max(1, math.ceil(cap * n)) for n in distinct]
        extra = "tinylfu = true\n" if args.tinylfu and cap < 1 else ""
        aucs = [test_auc(job(capacities, extra), data, s, args.epochs) for s in seeds]
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
    ax.plot(caps, [by_cap[str(c)]["auc_mean"] for c in caps], "o-",
            label="dynamic, LFU" + (" + TinyLFU admission" if args.tinylfu else ""))
    ax.axhline(float(np.mean(fixed)), color="gray", ls="--",
               label="fitted vocabulary" if movielens else "hashed, 2^18 rows")
    if movielens:
        ax.plot([0.5], [result["frequent_half_vocabulary"]["auc_mean"]], "s", color="gray",
                label="vocabulary of the most frequent half")
    ax.set_xlabel("capacity / distinct values")
    ax.set_ylabel(f"test AUC (mean of {args.seeds} seeds)")
    ax.set_title(f"{result['data']}: AUC against the cap", fontsize=10)
    ax.legend()
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = args.name or ("dynamic_cap_movielens" if movielens else "dynamic_cap")
    fig.savefig(RESULTS / f"{name}_cpu.png", dpi=100)
    result["plot"] = f"{name}_cpu.png"
    emit(name, result)


if __name__ == "__main__":
    main()
