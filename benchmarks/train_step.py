"""Throughput of one Wide & Deep training step with host tables (samples/s, lookups/s).

Criteo-shaped synthetic batch: 26 categorical features, each with a wide (dim 1) and a deep
(dim 16) host table of ``--rows`` rows, 13 dense features, MLP 256-128 on the device, FTRL on
the wide tables, LazyAdam on the deep tables, Adam on the MLP. Ids are uniform. A lookup is one
(table, id) pair: 52 per sample. ``--criteo FILE`` uses real rows of a Criteo TSV file instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

from hetero.data import BatchConfig, Batches, Feature, TabularDataset  # noqa: E402
from hetero.data.encode import fit  # noqa: E402
from hetero.data.reader_config import ReaderConfig  # noqa: E402
from hetero.data.readers import read_table  # noqa: E402
from hetero.data.schema import Categorical, Dense, Label, Schema, Transform  # noqa: E402
from hetero.embedding import dense_parameters, host_tables  # noqa: E402
from hetero.models.wide_deep import FeatureSlot, WideDeep, WideDeepConfig  # noqa: E402
from hetero.optim import FTRL, LazyAdam  # noqa: E402
from hetero.placement import Target, resolve_device  # noqa: E402


def synthetic(n: int, rows: int) -> TabularDataset:
    g = torch.Generator().manual_seed(0)
    feats = {f"C{i}": torch.randint(0, rows, (n,), generator=g) for i in range(1, 27)}
    specs = tuple(Feature(f"C{i}", rows) for i in range(1, 27))
    return TabularDataset(feats, torch.randn(n, 13, generator=g), torch.randint(0, 2, (n,), generator=g).float(), specs)


def criteo(path: Path, buckets: int) -> TabularDataset:
    """A Criteo TSV file (examples/criteo.toml's schema, ``buckets`` rows per table), encoded whole."""
    columns = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
    schema = Schema(Label("label"), tuple(Categorical(c, hash_buckets=buckets) for c in columns[14:]),
                    tuple(Dense(c, Transform.LOG1P) for c in columns[1:14]))
    table = read_table(path, schema, ReaderConfig(delimiter="\t", header=False, column_names=columns, quote_char=""))
    return fit(schema, table, str(path)).encode(table, str(path))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--criteo", type=Path, help="a Criteo TSV file (hashed into --rows buckets)")
    args = p.parse_args()

    torch.manual_seed(0)
    n = args.batch_size * (args.steps + args.warmup)
    data = criteo(args.criteo, args.rows) if args.criteo else synthetic(n, args.rows)
    device = resolve_device(Target.DEVICE)
    slots = [FeatureSlot(f.name, f.vocab_size) for f in data.specs]
    model = WideDeep(slots, data.num_dense, WideDeepConfig(embedding_dim=16, hidden=(256, 128))).to(device)
    tables = host_tables(model)
    wide = FTRL({k: t for k, t in tables.items() if k.startswith("wide.")})
    deep = LazyAdam({k: t for k, t in tables.items() if k.startswith("deep.")})
    dense = torch.optim.Adam(dense_parameters(model), lr=1e-3)
    batches = Batches(data, BatchConfig(batch_size=args.batch_size, shuffle=False))

    def step(batch):
        wide.zero_grad(), deep.zero_grad(), dense.zero_grad()
        logits = model(batch.features, batch.dense)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.label.to(device))
        loss.backward()
        dense.step(), wide.step(), deep.step()
        return loss.item()  # sync point: a step ends when the host has its loss

    it = iter(batches.epoch(0))
    pre = [next(it) for _ in range(min(args.steps + args.warmup, len(batches)))]
    for b in pre[: args.warmup]:
        step(b)
    timed = pre[args.warmup :]
    t0 = time.perf_counter()
    for b in timed:
        step(b)
    seconds = time.perf_counter() - t0
    samples = sum(len(b) for b in timed)
    lookups = samples * len(tables)
    emit("train_step", {
        "data": str(args.criteo) if args.criteo else "synthetic-uniform",
        "batch_size": args.batch_size, "rows_per_table": args.rows, "tables": len(tables), "steps": len(timed),
        "samples_per_s": samples / seconds, "lookups_per_s": lookups / seconds,
        "step_ms": 1000 * seconds / len(timed), "device_part_on": str(device),
    })


if __name__ == "__main__":
    main()
