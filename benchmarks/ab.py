"""Same-run A/B of a benchmark between two source trees (e.g. before and after a refactor).

Runs ``BENCH`` (a script under ``benchmarks/``) from tree A and tree B alternately, ``--rounds``
times each, each run in a fresh process with that tree's ``src`` first on ``PYTHONPATH``; reads
the numeric fields of each run's last JSON line and reports, per field, the median of each tree
and the ratio B / A. Alternating spreads the machine's drift over both sides.

    git worktree add /tmp/before <commit>
    python benchmarks/ab.py embedding_step --a /tmp/before --b . --rounds 3 -- --no-multi-table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402


def run(tree: Path, bench: str, args: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    out = subprocess.run([sys.executable, str(tree / "benchmarks" / f"{bench}.py"), *args], env=env,
                         capture_output=True, text=True, check=True).stdout
    last = json.loads(out.strip().splitlines()[-1])
    return {k: float(v) for k, v in _flat(last).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "env":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("bench", help="benchmark script name under benchmarks/ (without .py)")
    p.add_argument("--a", type=Path, required=True, help="tree A (the baseline)")
    p.add_argument("--b", type=Path, default=Path("."), help="tree B")
    p.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after "--": the benchmark's own arguments
    a = p.parse_args(argv[:cut])
    extra = argv[cut + 1 :]
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for _ in range(a.rounds):
        for side, tree in (("a", a.a), ("b", a.b)):
            runs[side].append(run(tree.resolve(), a.bench, extra))
    keys = sorted(set(runs["a"][0]) & set(runs["b"][0]))
    med = {s: {k: statistics.median(r[k] for r in runs[s]) for k in keys} for s in runs}
    result = {
        "bench": a.bench, "args": extra, "rounds": a.rounds,
        "a": str(a.a), "b": str(a.b),
        "a_commit": _commit(a.a), "b_commit": _commit(a.b),
        "median_a": med["a"], "median_b": med["b"],
        "ratio_b_over_a": {k: med["b"][k] / med["a"][k] for k in keys if med["a"][k]},
        "runs": runs,
    }
    emit(f"ab_{a.bench.replace('/', '_')}", result)  # (a script in a folder: peers/systems)


def _commit(tree: Path) -> str:
    r = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
