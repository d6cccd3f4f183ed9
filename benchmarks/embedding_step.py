"""Host embedding train step: lookup + coalesce + sparse optimizer, lookups/s.

One 1M x 16 fp32 table, batches of 4096 x 26 ids drawn uniform and Zipf(1.05) (hot ids scattered
over the table by a fixed permutation), fresh ids every step. A step is the forward lookup
((4096, 26, 16) output), the backward with a fixed upstream gradient, and the optimizer step.
Same run: the torch baseline (``nn.Embedding(sparse=True)`` + ``SparseAdam`` / ``Adagrad`` /
``SGD``), raw ``index_select`` rows/s on fresh ids (the memory limit: the best of three
measurements spread over the run), and a 26-table collection
(26 x 1M x 16, one table per field, one kernel call per step) with LazyAdam. Against the machine:
each optimizer's random accesses per lookup (:func:`accesses_per_lookup`) times its lookups/s, over
``index_select``'s rows/s (issue #39's target 1: >= 0.6).

``--dynamic``: dynamic tables (raw int64 keys, :mod:`hetero.dynamic`) against the fixed-row table
on the same draws (the fixed table's ids are the keys' indices), at ``--rows`` and ten times as
many distinct keys, Zipf(1.05), row-wise Adagrad and LazyAdam, the three tables taking turns in
one process: the rate over the fixed one's of a dynamic table that holds every key (issue #38's
target: >= 0.7) and of one that admits the keys as they first come.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu, emit  # noqa: E402
from _workload import id_arrays, in_turn_seconds, timed  # noqa: E402

from hetero.dynamic import Keys  # noqa: E402
from hetero.embedding import HostEmbedding, HostEmbeddingCollection, TableConfig  # noqa: E402
from hetero.optim import SparseOptimizerKind  # noqa: E402
from hetero.placement.memory import retain_freed_memory  # noqa: E402

B, F, D = 4096, 26, 16


# Each optimizer's state arrays, read-modified-written beside the row for every distinct row of a step.
STATE_ARRAYS = {SparseOptimizerKind.LAZY_ADAM: 2, SparseOptimizerKind.FTRL: 2, SparseOptimizerKind.ADAGRAD: 1,
                SparseOptimizerKind.ROWWISE_ADAGRAD: 1, SparseOptimizerKind.SGD: 0}


def accesses_per_lookup(kind: SparseOptimizerKind, unique_fraction: float) -> float:
    """The random accesses a step makes per id looked up (issue #39, target 1): the id's dedup
    marker and its row's read for the lookup, then for each distinct row (``unique_fraction`` of
    the ids) the read-modify-write of the row and of each of the optimizer's state arrays (a group
    of 1 GiB or more sorts instead of reading a marker: not the tables here). Each is
    one cache line or more at a random place in an array larger than the caches, as a row of a
    bare ``index_select`` is: the step's accesses/s over ``index_select``'s rows/s is the share of
    the machine's random-access rate the step reaches."""
    return 2 + unique_fraction * (1 + STATE_ARRAYS[kind])


def id_batches(dist: str, rows: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    return [torch.from_numpy(a) for a in id_arrays(dist, rows, count, (B, F), seed)]


def step_rate(module, opt, batches, warmup: int) -> float:
    """Lookups/s of forward + backward (fixed upstream gradient) + optimizer step."""
    upstream = torch.randn(B, F, D)

    def step(ids):
        opt.zero_grad()
        module(ids).backward(upstream)
        opt.step()

    return B * F / timed(step, batches, warmup)


def hetero_step_rate(kind: SparseOptimizerKind, batches, rows: int, warmup: int) -> float:
    torch.manual_seed(0)
    table = HostEmbedding(TableConfig("t", rows, D))
    return step_rate(table, kind.optimizer([table]), batches, warmup)


def torch_step_rate(make_opt, batches, rows: int, warmup: int) -> float:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(rows, D, sparse=True)
    return step_rate(emb, make_opt(emb.parameters()), batches, warmup)


def multi_table_rate(batches, rows: int, warmup: int) -> float:
    torch.manual_seed(0)
    coll = HostEmbeddingCollection([TableConfig(f"C{i}", rows, D) for i in range(F)])
    opt = SparseOptimizerKind.LAZY_ADAM.optimizer(coll.tables.values())
    upstream = torch.randn(B, D)

    def step(ids):
        opt.zero_grad()
        out = coll({f"C{i}": ids[:, i] for i in range(F)})
        torch.autograd.backward(list(out.values()), [upstream] * F)
        opt.step()

    return B * F / timed(step, batches, warmup)


def held(table: HostEmbedding, keys: np.ndarray, chunk: int = 1 << 20) -> None:
    """Admit every one of ``keys`` into the dynamic ``table`` (training lookups, no update): it then
    holds them all, as a table trained long enough on these keys does."""
    for lo in range(0, keys.shape[0], chunk):
        table.rows_of(torch.from_numpy(keys[lo : lo + chunk]))


def dynamic_rates(rows: int, steps: int, warmup: int, block: int = 5) -> dict:
    """Fixed against dynamic at ``rows`` distinct keys, per optimizer: lookups/s of the fixed table,
    a dynamic table that holds every key (``held``: lookup + update at ``rows`` keys) and one that
    admits them as they come (``arriving``: at 10M keys, two thirds of a step's distinct keys are
    new), all three in one process taking turns of ``block`` steps (:func:`_workload.in_turn_seconds`); a
    ratio is the median over the turns of the two tables' ratio in one turn."""
    rng = np.random.default_rng(1)
    keys = rng.integers(-(2**62), 2**62, rows)  # the raw keys; the fixed table's id of keys[i] is i
    index = id_batches("zipf", rows, warmup + steps)
    raw = [torch.from_numpy(keys[b.numpy()]) for b in index]
    upstream = torch.randn(B, F, D)
    out: dict = {}
    for kind in (SparseOptimizerKind.ROWWISE_ADAGRAD, SparseOptimizerKind.LAZY_ADAM):
        runs = {}
        for mode in ("fixed", "held", "arriving"):
            torch.manual_seed(0)
            table = HostEmbedding(TableConfig("t", rows, D, keys=Keys.FIXED if mode == "fixed" else Keys.DYNAMIC))
            if mode == "held":
                held(table, keys)
            opt = kind.optimizer([table])

            def run(part, table=table, opt=opt, fixed=mode == "fixed"):
                for i in part:
                    opt.zero_grad()
                    table(index[i] if fixed else raw[i]).backward(upstream)
                    opt.step()

            run(range(warmup))
            runs[mode] = run
        parts = [range(i, i + block) for i in range(warmup, warmup + steps - block + 1, block)]
        seconds = {k: np.array(v) for k, v in in_turn_seconds(runs, parts).items()}
        rate = {k: B * F / float(np.median(v)) for k, v in seconds.items()}
        # each ratio: the median over the turns of the fixed table's seconds over the other's, in one turn
        ratio = {k: float(np.median(seconds["fixed"] / seconds[k])) for k in ("held", "arriving")}
        out[kind.value] = {f"{k}_lookups_per_s": v for k, v in rate.items()}
        out[kind.value].update(held_over_fixed=ratio["held"], arriving_over_fixed=ratio["arriving"])
        print(f"{rows:>9d} keys {kind.value:16s} fixed {rate['fixed'] / 1e6:6.2f} M/s held {rate['held'] / 1e6:6.2f} "
              f"({ratio['held']:.2f}) arriving {rate['arriving'] / 1e6:6.2f} ({ratio['arriving']:.2f})",
              file=sys.stderr)
        del runs
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-multi-table", action="store_true", help="skip the 26-table case (5 GB of host memory)")
    p.add_argument("--dynamic", action="store_true", help="only the dynamic table against the fixed one")
    p.add_argument("--name", default=None, help="the results file's name (default embedding_step, with --dynamic "
                   "embedding_step_dynamic)")
    args = p.parse_args()
    retain_freed_memory()  # (as the hetero command does: a step's freed buffers are not faulted in again)
    if args.dynamic:
        result = {"table_dim": D, "batch": f"{B} x {F}", "steps": args.steps, "distribution": "zipf(1.05)",
                  "cpu": cpu()}
        for rows in (args.rows, 10 * args.rows):
            result[f"keys_{rows}"] = dynamic_rates(rows, args.steps, args.warmup)
        for mode in ("held", "arriving"):
            result[f"{mode}_over_fixed_min"] = min(v[f"{mode}_over_fixed"] for k, r in result.items()
                                                   if k.startswith("keys_") for v in r.values())
        emit(args.name or "embedding_step_dynamic", result)
        return
    count = args.steps + args.warmup
    result: dict = {"table": f"{args.rows} x {D} fp32", "batch": f"{B} x {F}", "steps": args.steps, "cpu": cpu()}
    baselines = {
        SparseOptimizerKind.LAZY_ADAM: ("torch_sparse_adam", lambda ps: torch.optim.SparseAdam(ps, lr=1e-3)),
        SparseOptimizerKind.ADAGRAD: ("torch_sparse_adagrad", lambda ps: torch.optim.Adagrad(ps, lr=1e-2)),
        SparseOptimizerKind.SGD: ("torch_sparse_sgd", lambda ps: torch.optim.SGD(ps, lr=1e-2)),
    }
    for dist in ("uniform", "zipf"):
        batches = id_batches(dist, args.rows, count)
        sfx = "" if dist == "uniform" else "_zipf"
        result[f"unique_fraction{sfx}"] = float(np.mean([b.unique().numel() / b.numel() for b in batches]))
        table = torch.randn(args.rows, D)
        flat = [b.reshape(-1) for b in batches]
        # The memory limit is the best of three index_select measurements spread over the run (one
        # alone swung 50-100 M rows/s on this shared VM): the fraction reported is conservative.
        selects = []

        def measure_index_select() -> None:
            selects.append(B * F / timed(lambda ids: table.index_select(0, ids), flat, args.warmup))

        measure_index_select()
        for kind in SparseOptimizerKind:
            rate = hetero_step_rate(kind, batches, args.rows, args.warmup)
            if kind in (SparseOptimizerKind.LAZY_ADAM, SparseOptimizerKind.SGD):
                measure_index_select()
            result[f"{kind.value}_lookups_per_s{sfx}"] = rate
            print(f"{dist:8s} hetero {kind.value:16s} {rate / 1e6:7.2f} M lookups/s", file=sys.stderr)
            if kind in baselines:
                name, make = baselines[kind]
                base = torch_step_rate(make, batches[: args.warmup + 15], args.rows, 2)
                result[f"{name}_lookups_per_s{sfx}"] = base
                print(f"{dist:8s} torch  {name:16s} {base / 1e6:7.2f} M lookups/s", file=sys.stderr)
        result[f"index_select_rows_per_s{sfx}"] = max(selects)
        result[f"index_select_measurements{sfx}"] = selects
        for kind in SparseOptimizerKind:
            per = accesses_per_lookup(kind, result[f"unique_fraction{sfx}"])
            fraction = result[f"{kind.value}_lookups_per_s{sfx}"] * per / max(selects)
            result[f"{kind.value}_accesses_per_lookup{sfx}"] = per
            result[f"{kind.value}_access_fraction{sfx}"] = fraction
            print(f"{dist:8s} hetero {kind.value:16s} {per:.2f} accesses a lookup: {fraction:.0%} of index_select's "
                  f"rate", file=sys.stderr)
        if dist == "uniform" and not args.no_multi_table:
            result["multi_table_lazy_adam_lookups_per_s"] = multi_table_rate(batches, args.rows, args.warmup)
    result["lazy_adam_speedup_vs_torch"] = result["lazy_adam_lookups_per_s"] / result["torch_sparse_adam_lookups_per_s"]
    result["lazy_adam_fraction_of_index_select"] = result["lazy_adam_lookups_per_s"] / result["index_select_rows_per_s"]
    result["access_fraction_min"] = min(v for k, v in result.items() if "_access_fraction" in k)  # (target: 0.6)
    emit(args.name or "embedding_step", result)


if __name__ == "__main__":
    main()
