"""The DLRM training step against its dense part alone (issue #39, target 2: >= 0.95), with and
without the next batch's embedding work prepared on the prefetch worker.

A Criteo-shaped DLRM (``hetero.models.dlrm``): 26 tables of ``--rows`` x 16 (row-wise Adagrad),
13 dense features, bottom MLP 512-256-64-16, dot interaction, top MLP 512-256-1 (the reference
implementation's Criteo Kaggle shape, facebookresearch/dlrm), Adam; batches of
4096 on Zipf(1.05) or uniform ids. Three steps, in one process, in blocks of ``--block`` steps,
one block of each in turn (this VM's speed moves by up to half between processes):

* ``dense``: the same model whose embeddings are fixed tensors (they take a gradient, nothing
  is looked up or updated): the bottom MLP, the interaction, the top MLP and Adam;
* ``full``: the whole step, lookups and sparse updates on the training thread;
* ``prefetch``: the whole step under :class:`hetero.embedding.Prefetcher` (the next batch's ids
  checked and deduplicated on the worker thread while this batch trains, with a GPU its inverse map
  sent; exact, as tested);
* ``prefetch_rows`` (with a GPU): the same, gathering and sending the rows ahead too
  (``PrefetchConfig(gather_rows=True)``): the rows this batch's update overtakes are gathered again.

On a host without an accelerator the dense part runs on the same cores as the embedding work:
what the worker can hide is bounded by the cores the dense step leaves idle.

    python benchmarks/dlrm_step.py --rows 1000000
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu, emit  # noqa: E402
from _workload import id_arrays, in_turn  # noqa: E402

from hetero.embedding import PrefetchConfig, Prefetcher  # noqa: E402
from hetero.models.dlrm import DLRM, DLRMConfig  # noqa: E402
from hetero.models.wide_deep import FeatureSlot  # noqa: E402
from hetero.optim import SparseOptimizerKind  # noqa: E402
from hetero.placement import Target, resolve_device  # noqa: E402
from hetero.placement.memory import retain_freed_memory  # noqa: E402
from hetero.storage.config import SsdConfig  # noqa: E402

B, F, K, D = 4096, 26, 13, 16
CONFIG = DLRMConfig(embedding_dim=D, bottom=(512, 256, 64), top=(512, 256))


class FixedVectors(nn.Module):
    """Stands in for the tables: the same ``(B, D)`` values every step, as fresh leaves that take a
    gradient (the dense part's backward computes the embeddings' gradients, nothing receives them)."""

    def __init__(self, names: list[str], device: torch.device, dim: int = D) -> None:
        super().__init__()
        self.vectors = {n: torch.randn(B, dim, device=device) for n in names}
        self.tables = {"fixed": None}  # (DLRM's forward asks whether it has tables)

    def forward(self, features) -> dict[str, torch.Tensor]:  # noqa: ANN001
        return {n: v.detach().requires_grad_() for n, v in self.vectors.items()}


def build(rows: int, dense_only: bool, dim: int = D, ssd: SsdConfig | None = None):
    """A DLRM and its step ``step(batch, update)``; ``dense_only``: the tables replaced by fixed vectors;
    ``dim``: the tables' width (and the bottom MLP's output); ``ssd``: the tables on that SSD tier."""
    torch.manual_seed(0)
    device = resolve_device(Target.DEVICE)
    config = dataclasses.replace(CONFIG, embedding_dim=dim)
    model = DLRM([FeatureSlot(f"C{i}", rows) for i in range(F)], K, config, ssd=ssd).to(device)
    sparse = None
    if dense_only:
        model.deep = FixedVectors([f"C{i}" for i in range(F)], device, dim)
    else:
        sparse = SparseOptimizerKind.ROWWISE_ADAGRAD.optimizer(model.deep.tables.values())
    dense = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("deep.")], lr=1e-3)

    def step(batch, update: Callable[[Any], None] = lambda sparse: sparse.step()) -> float:  # noqa: ANN001
        """One step; ``update(sparse)`` applies the tables' update (``dlrm_overlap.py`` hands it to a worker)."""
        features, x, y = batch
        dense.zero_grad()
        if sparse is not None:
            sparse.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(features, x), y.to(device))
        loss.backward()
        dense.step()
        if sparse is not None:
            update(sparse)
        return loss.item()  # sync point: a step ends when the host has its loss

    return model, step


def batches(dist: str, rows: int, count: int) -> list:
    ids = id_arrays(dist, rows, count, (B, F))
    g = torch.Generator().manual_seed(1)
    return [({f"C{i}": torch.from_numpy(a[:, i].copy()) for i in range(F)}, torch.randn(B, K, generator=g),
             torch.randint(0, 2, (B,), generator=g).float()) for a in ids]


def measure(dist: str, rows: int, blocks: int, block: int) -> dict:
    dense_model, dense = build(rows, True)
    model, full = build(rows, False)
    work = batches(dist, rows, block * blocks + block)
    for b in work[:block]:  # warm-up (numba's kernels compile, the allocator settles)
        dense(b), full(b)

    def prefetched(part: list, config: PrefetchConfig = PrefetchConfig()) -> None:
        for b in Prefetcher(model, part, config, features=lambda b: b[0]):
            full(b)

    runs = {"dense": lambda part: [dense(b) for b in part], "full": lambda part: [full(b) for b in part],
            "prefetch": prefetched}
    if torch.cuda.is_available():  # (on a host without one, rows are read in place: nothing to gather ahead)
        runs["prefetch_rows"] = lambda part: prefetched(part, PrefetchConfig(gather_rows=True))
    parts = [work[block * (i + 1) : block * (i + 2)] for i in range(blocks)]
    seconds = in_turn(runs, parts)
    rate = {k: B / v for k, v in seconds.items()}
    return {"samples_per_s": rate, "full_over_dense": rate["full"] / rate["dense"],
            "prefetch_over_dense": rate["prefetch"] / rate["dense"], "prefetch_over_full": rate["prefetch"] / rate["full"],
            **({"prefetch_rows_over_dense": rate["prefetch_rows"] / rate["dense"]} if "prefetch_rows" in rate else {})}


def arguments(doc: str, name: str) -> argparse.Namespace:
    """The command line of a DLRM benchmark (this one, ``dlrm_overlap.py``): ``--rows``,
    ``--blocks``, ``--block``, ``--name`` (default ``name``); freed memory kept from here on."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    p.add_argument("--blocks", type=int, default=8, help="blocks of each way")
    p.add_argument("--block", type=int, default=10, help="steps a block")
    p.add_argument("--name", default=name)
    args = p.parse_args()
    retain_freed_memory()  # (as the hetero command does: a step's freed buffers are not faulted in again)
    return args


def main() -> None:
    args = arguments(__doc__, "dlrm_step")
    result = {"rows_per_table": args.rows, "tables": F, "dim": D, "batch_size": B, "bottom": list(CONFIG.bottom),
              "top": list(CONFIG.top), "optimizer": "adam + rowwise_adagrad", "block": args.block,
              "threads": torch.get_num_threads(), "cpu": cpu()}
    for dist in ("zipf", "uniform"):
        result[dist] = measure(dist, args.rows, args.blocks, args.block)
        print(dist, result[dist], file=sys.stderr)
    result["full_over_dense_zipf"] = result["zipf"]["full_over_dense"]
    result["prefetch_over_dense_zipf"] = result["zipf"]["prefetch_over_dense"]
    emit(args.name, result)


if __name__ == "__main__":
    main()
