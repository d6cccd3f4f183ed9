"""Dynamic tables over data-parallel ranks: one key exchange per lookup for all of a table group's
dynamic tables (``hetero.embedding.dynamic_rows.DynamicRows.rows_of``) against one exchange per
table (the baseline: the same call made table by table), same run.

The Criteo job with all 26 categorical features dynamic (capacity 4096 each, one table group) is
trained for one epoch by ``hetero train`` on ``--ranks`` ranks (gloo, one thread each), replicated
(every rank gathers every rank's keys: two all-gathers an exchange) and row-sharded (each key to
its owner and its row back: three all-to-alls an exchange), in alternating rounds; samples/s,
the median of ``--rounds``, and one exchange's rate over the per-table one's.

    python benchmarks/dynamic_exchange.py --data ../shared/data/criteo_kaggle_first8k.tsv
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, spawn_ranks  # noqa: E402

COLUMNS = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]


def job_text(data: Path, capacity: int) -> str:
    dense = "".join(f'[[schema.dense]]\ncolumn = "I{i}"\ntransform = "log1p"\n' for i in range(1, 14))
    cats = "".join(f'[[schema.categorical]]\ncolumn = "C{i}"\ndynamic = true\ncapacity = {capacity}\nrole = "deep"\n'
                   for i in range(1, 27))
    return (f'[data]\npath = "{data}"\ndelimiter = "\\t"\nheader = false\ncolumn_names = {json.dumps(COLUMNS)}\n'
            f'[schema]\nlabel = {{ column = "label" }}\n{dense}{cats}')


def _rank(rank: int, n: int, per_table: bool, argv: list[str], port: int, out) -> None:  # noqa: ANN001 - a dict proxy
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n), CUDA_VISIBLE_DEVICES="")
    import torch

    torch.set_num_threads(1)
    from hetero.embedding.dynamic_rows import DynamicRows

    if per_table:  # the baseline: the same exchange, one table at a time
        fused = DynamicRows.rows_of
        DynamicRows.rows_of = lambda self, lookups: [fused(self, [one])[0] for one in lookups]
    from hetero.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(argv)
    if code != 0:
        raise SystemExit(code)
    if rank == 0:
        out["result"] = json.loads(printed.getvalue().strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" /
                   "criteo_kaggle_first8k.tsv")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--capacity", type=int, default=4096)
    args = p.parse_args()
    result: dict = {"ranks": args.ranks, "tables": 26, "batch_size": args.batch_size, "capacity": args.capacity,
                    "data": args.data.name}
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.toml"
        job.write_text(job_text(args.data.resolve(), args.capacity))
        for sharding in ("replicated", "row"):
            rates: dict[str, list[float]] = {"one_exchange": [], "per_table": []}
            for r in range(args.rounds):
                for mode in rates:
                    argv = ["train", "--config", str(job), "--batch-size", str(args.batch_size), "--epochs", "1",
                            "--no-progress", "--table-sharding", sharding, "--run-dir", str(Path(tmp) / f"{sharding}{r}{mode}")]
                    got = spawn_ranks(_rank, args.ranks, mode == "per_table", argv)["result"]
                    rates[mode].append(got["samples_per_s"])
                    print(f"{sharding:10s} {mode:12s} {got['samples_per_s']:8.0f} samples/s", file=sys.stderr)
            one, per = float(np.median(rates["one_exchange"])), float(np.median(rates["per_table"]))
            result[sharding] = {"one_exchange_samples_per_s": one, "per_table_samples_per_s": per,
                                "one_over_per_table": one / per, "rounds": rates}
    result["one_over_per_table_min"] = min(result[s]["one_over_per_table"] for s in ("replicated", "row"))
    emit("dynamic_exchange", result)


if __name__ == "__main__":
    main()
