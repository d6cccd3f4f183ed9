"""Peak resident memory of the pipelined Criteo job (issue: `--pp 2` on `examples/criteo.toml` was
killed at 18-20 GB by the kernel; its checkpoint gather pickled each table view with the whole
collection's storage).

Runs ``torchrun --standalone --nproc-per-node 2 -m hetero train --config examples/criteo.toml
--pp 2 --batch-size 64 --max-steps 3`` on the first ``--lines`` lines of a Criteo TSV (default:
``../shared/data/criteo_kaggle_first8k.tsv`` if present, else seeded synthetic lines of the same
format) and reports the largest rank's peak resident set (``ru_maxrss`` of the waited-for
descendants: the launcher's ranks) beside the tables' bytes. The 52 tables of 262,144 rows hold
463 MB; each rank holds its stage, stage 0 the tables and their LazyAdam / FTRL state.
"""

from __future__ import annotations

import argparse
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import emit

ROOT = Path(__file__).resolve().parents[1]


def _synthetic(n: int) -> str:
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        ints = [str(rng.randint(0, 50)) if rng.random() > 0.2 else "" for _ in range(13)]
        cats = [f"{rng.randint(0, 10**6):08x}" if rng.random() > 0.1 else "" for _ in range(26)]
        rows.append("\t".join([str(rng.randint(0, 1)), *ints, *cats]))
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=2001)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "criteo_kaggle_first8k.tsv")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "criteo.tsv"
        if args.data.is_file():
            with open(args.data) as f:
                data.write_text("".join(line for _, line in zip(range(args.lines), f)))
            source = f"{args.data.name}, first {args.lines} lines"
        else:
            data.write_text(_synthetic(args.lines))
            source = f"synthetic, {args.lines} lines"
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "-m", "hetero", "train", "--config", str(ROOT / "examples" / "criteo.toml"),
                              "--data-path", str(data), "--batch-size", "64", "--max-steps", "3", "--pp", "2",
                              "--run-dir", str(Path(d) / "run"), "--no-progress"],
                             capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
    if run.returncode:
        raise SystemExit(f"the pipelined job failed:\n{run.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB, the largest rank
    emit("pp_memory", {"job": "criteo.toml --pp 2, batch 64, 3 steps, a checkpoint at the end", "data": source,
                       "tables_gb": 0.4635, "peak_rss_gib_largest_rank": round(peak, 2), "wall_s": round(wall, 1),
                       "before": "killed by the kernel at 18-20 GB (issue #35, item 17)"})


if __name__ == "__main__":
    main()
