"""Data pipeline throughput and memory on a generated file of Criteo's shape.

The file: ``--rows`` lines of label, 13 integer fields (Zipf-distributed counts, 20% empty) and 26
categorical fields written as 8 hex digits, with the Kaggle set's per-field cardinalities (3 to
10M distinct values, Zipf-distributed ids, 5% empty), tab-separated, no header (about 250 bytes
a line, as the real file). The schema: 26 hashed categorical columns, 13 dense ``log1p``.

Measured (same run, same file):

* ``tsv_rows_per_s``: streaming read + encode (:func:`hetero.data.stream.encoded_blocks`:
  pyarrow decoding on a reader thread, hashing and transforms here), rows/s over the file.
* ``stream_batches_rows_per_s``: the same plus the window shuffle and batching the trainer takes
  (:class:`~hetero.data.stream.StreamBatches`, batch 4096).
* ``prepare_rows_per_s``: ``hetero data prepare`` (one pass: nothing to fit with hashing).
* ``prepared_rows_per_s``: shuffled batches of 4096 from the memory-mapped cache (``Batches``
  over :class:`~hetero.data.prepare.PreparedDataset`, page cache warm).
* ``streaming_over_memory``: ``hetero train --stream`` samples/s over the same job read into
  memory (W&D, batch 4096, ``--max-steps``; the trainer's steady-state rate), each in a process
  of its own; ``peak_rss_bytes``: the streamed run's peak resident memory, also at a tenth of the
  file (``peak_rss_bytes_tenth``): bounded means it does not grow with the file; and its growth
  after the first step (``peak_rss_beyond_first_step_bytes``: by then the model, the tables and
  the optimizers exist - what is left is the stream's windows and queues, and optimizer rows
  first touched later). The in-memory run's peak beside it.

    python benchmarks/data_pipeline.py [--rows 10000000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)  # Criteo Kaggle, per field
NAMES = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]


def generate(path: Path, rows: int, seed: int, chunk: int = 1_000_000) -> None:
    """Write ``rows`` Criteo-shaped lines to ``path`` (see the module docstring)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as csv

    rng = np.random.default_rng(seed)
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    with open(path, "wb") as f:
        for start in range(0, rows, chunk):
            m = min(chunk, rows - start)
            cols = {"label": pa.array((rng.random(m) < 0.26).astype(np.int8))}
            for i in range(13):
                cols[f"I{i + 1}"] = pa.array(rng.zipf(1.5, m).astype(np.int64) - 1, mask=rng.random(m) < 0.2)
            for i, card in enumerate(CARDINALITIES):
                h = ((rng.zipf(1.2, m) % card).astype(np.uint32) * np.uint32(2654435761)).astype(np.uint32)
                text = np.empty((m, 8), dtype=np.uint8)
                for k in range(8):  # 8 hex digits, as Criteo writes its hashed values
                    text[:, 7 - k] = digits[(h >> np.uint32(4 * k)) & np.uint32(15)]
                values = pa.FixedSizeBinaryArray.from_buffers(pa.binary(8), m, [None, pa.py_buffer(text.tobytes())])
                values = values.cast(pa.binary()).cast(pa.string())
                cols[f"C{i + 1}"] = pc.if_else(pa.array(rng.random(m) < 0.05), pa.nulls(m, pa.string()), values)
            csv.write_csv(pa.table(cols), f, csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none"))


def job_file(directory: Path, train: Path, buckets: int) -> Path:
    cat = "".join(f'[[schema.categorical]]\ncolumn = "C{i}"\nhash_buckets = {buckets}\n\n' for i in range(1, 27))
    dense = "".join(f'[[schema.dense]]\ncolumn = "I{i}"\ntransform = "log1p"\n\n' for i in range(1, 14))
    names = ", ".join(f'"{n}"' for n in NAMES)
    text = (f'[data]\npath = "{train}"\nvalid_path = "{directory / "valid.tsv"}"\ntest_path = "{directory / "test.tsv"}"\n'
            f'delimiter = "\\t"\nheader = false\nquote_char = ""\ncolumn_names = [{names}]\n\n'
            f'[schema]\nlabel = {{ column = "label", positive = ["1"] }}\n\n{cat}{dense}')
    path = directory / f"job_{train.stem}.toml"
    path.write_text(text)
    return path


_CHILD = """
import json, resource, sys
from hetero.cli import main
first = {}
def on_step(trainer):  # resident memory once the model, tables and optimizers exist and one step ran
    if not first:
        with open("/proc/self/statm") as f:
            first["rss"] = int(f.read().split()[1]) * resource.getpagesize()
code = main(sys.argv[1:], on_step=on_step)
print(json.dumps({"code": code, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "rss_first_step_bytes": first.get("rss")}))
"""


def train(job: Path, run_dir: Path, steps: int, *flags: str) -> dict:
    """``hetero train`` in a process of its own: its metrics and peak resident memory."""
    argv = ["train", "--config", str(job), "--run-dir", str(run_dir), "--batch-size", "4096", "--max-steps",
            str(steps), "--epochs", "1", "--no-progress", "--embedding-dim", "16", "--overwrite", *flags]
    out = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True, check=False)
    lines = out.stdout.strip().splitlines()
    if out.returncode or len(lines) < 2:
        raise RuntimeError(f"hetero train {' '.join(flags)} failed:\n{out.stderr[-3000:]}")
    return {**json.loads(lines[-2]), **json.loads(lines[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=300, help="training steps of batch 4096 per run")
    parser.add_argument("--buckets", type=int, default=1 << 18, help="hash buckets per categorical field")
    parser.add_argument("--dir", type=Path, help="work directory (default: a temporary one, removed)")
    args = parser.parse_args()
    from hetero.data.prepare import load_prepared, prepare
    from hetero.data.reader_config import ReaderConfig
    from hetero.data.schema import Categorical, Dense, Label, Schema, Transform
    from hetero.data.stream import StreamBatches, StreamConfig, encoded_blocks, fit_stream
    from hetero.data.tabular import BatchConfig, Batches

    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    work = Path(tmp.name)
    big, tenth = work / "train.tsv", work / "train_tenth.tsv"
    t0 = time.perf_counter()
    generate(big, args.rows, seed=0)
    generate(tenth, args.rows // 10, seed=0)
    generate(work / "valid.tsv", 100_000, seed=1)
    generate(work / "test.tsv", 100_000, seed=2)
    print(f"generated {args.rows} rows ({big.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)

    schema = Schema(Label("label", positive=("1",)),
                    tuple(Categorical(f"C{i}", hash_buckets=args.buckets) for i in range(1, 27)),
                    tuple(Dense(f"I{i}", Transform.LOG1P) for i in range(1, 14)))
    reader = ReaderConfig(delimiter="\t", header=False, column_names=tuple(NAMES), quote_char="")
    encoding = fit_stream(big, schema, reader)
    result: dict = {"rows": args.rows, "file_bytes": big.stat().st_size}

    def rate(label: str, count) -> float:  # noqa: ANN001 - a callable returning rows
        start = time.perf_counter()
        rows = count()
        seconds = time.perf_counter() - start
        print(f"{label}: {rows} rows in {seconds:.1f} s, {rows / seconds / 1e6:.2f}M rows/s", file=sys.stderr)
        return rows / seconds

    result["tsv_rows_per_s"] = rate("read + encode", lambda: sum(len(b) for b in encoded_blocks(big, encoding, reader)))
    stream = StreamBatches(big, encoding, reader, BatchConfig(batch_size=4096, seed=0), StreamConfig())
    result["stream_batches_rows_per_s"] = rate("+ shuffle, batches", lambda: sum(len(b) for b in stream.epoch(0)))
    cache = work / "cache"
    # (prepare also encodes the validation and test files: 200,000 rows)
    result["prepare_rows_per_s"] = rate("prepare", lambda: prepare(big, schema, cache, reader, _all_train_split(work))
                                        and args.rows + 200_000)
    train_split = load_prepared(cache)[0]
    batches = Batches(train_split, BatchConfig(batch_size=4096, seed=0))
    sum(len(b) for b in batches.epoch(0))  # the page cache warm: the epochs after the first
    result["prepared_rows_per_s"] = rate("prepared, shuffled", lambda: sum(len(b) for b in batches.epoch(1)))

    job, job_tenth = job_file(work, big, args.buckets), job_file(work, tenth, args.buckets)
    streamed = train(job, work / "run_stream", args.steps, "--stream")
    streamed_tenth = train(job_tenth, work / "run_stream_tenth", args.steps, "--stream")
    memory = train(job, work / "run_memory", args.steps)
    result.update({
        "streaming_over_memory": streamed["samples_per_s"] / memory["samples_per_s"],
        "stream_samples_per_s": streamed["samples_per_s"], "memory_samples_per_s": memory["samples_per_s"],
        "peak_rss_bytes": streamed["peak_rss_bytes"], "peak_rss_bytes_tenth": streamed_tenth["peak_rss_bytes"],
        # what the stream (and training after its first step) adds to the model, tables, optimizers
        "peak_rss_beyond_first_step_bytes": streamed["peak_rss_bytes"] - streamed["rss_first_step_bytes"],
        "memory_run_peak_rss_bytes": memory["peak_rss_bytes"], "train_steps": args.steps, "batch_size": 4096,
        "hash_buckets": args.buckets,
    })
    emit("data_pipeline", result)


def _all_train_split(work: Path):  # noqa: ANN202 - a Split
    """The benchmark's split: the generated file trains; validation and test are files of their own."""
    from hetero.data.split import Split

    return Split(valid_path=work / "valid.tsv", test_path=work / "test.tsv")


if __name__ == "__main__":
    main()
