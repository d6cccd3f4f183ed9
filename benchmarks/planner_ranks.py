"""The planner at 2 ranks: predicted against measured step time of multi-rank plans, and the
chosen plan against a grid of hand-written ones, on gloo ranks of this machine.

Four models of ``benchmarks/planner.py`` - the GPT example's decoder (AdamW), the seed's MNIST
MLP (SGD), ResNet-50 (momentum SGD) and the DLRM with 26 host tables (AdamW, LazyAdam) - are
planned for ``world_size=2`` in this process and run on 2 spawned gloo ranks.
The ranks share this machine's cores: each runs ``cores / 2`` intra-op threads, and the planner
plans with that many (its calibration is keyed by the thread count: a rank's rates, measured on
the machine it runs on). The grid: every mesh the planner offers (dp 2 at ZeRO 0-3 - the DLRM's
tables replicated and row-sharded at each - pp 2, tp 2),
the GPT's optimizer state on the host beside dp (all of it, and half), the first half of the
units on the host beside dp (every replica's: their gradients averaged apart from DDP's) and
beside ZeRO 3 (FSDP2 over the device units), the first half of the streamable units' weights
on the host beside dp, each priced by the same cost model. Each distinct plan runs ``steps`` timed steps after 3 warm-up ones on both ranks (its step time:
the slower rank's median), in two rounds, keeping each plan's faster one.

Result (last line, also benchmarks/results/planner_ranks_<cpu|cuda>.json):
median_prediction_error and worst_prediction_error (|predicted - measured| / measured over every
plan executed), fraction_within_5pct_of_best (models whose chosen plan measured at most 5% slower
than the fastest grid plan), max_plan_seconds.

    python benchmarks/planner_ranks.py [--models gpt,mnist_mlp,resnet50,dlrm] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, spawn_ranks  # noqa: E402
from planner import Model, key, models  # noqa: E402 - the single-rank benchmark's models and plan identity

from hetero.placement import Target  # noqa: E402
from hetero.planner.calibration import calibrate  # noqa: E402
from hetero.planner.plan import Plan  # noqa: E402
from hetero.planner.planner import Planner  # noqa: E402
from hetero.planner.space import STREAMED, Candidate, OptimizerKind, StateHome, TablePlacement, UnitChoice  # noqa: E402

WORLD = 2


def grid(planner: Planner, optimizer: OptimizerKind) -> dict[str, Plan]:
    """The hand-written multi-rank plans (see the module docstring)."""
    out: dict[str, Plan] = {}
    m = min(c.micro_batches for c in planner.settings if c.pp == 1)
    tabled = any(u.tables for u in planner.cost.units)  # (its tables replicated below, unless said)
    places = (TablePlacement.REPLICATED, TablePlacement.ROW_SHARDED) if tabled else (TablePlacement.HOST,)
    for zero in (0, 1, 2, 3):
        for place in places:
            c = Candidate(dp=WORLD, zero=zero, micro_batches=m, tables=place)
            if c in planner.settings:
                out[f"dp {WORLD}, ZeRO {zero}" + (f", {place.value} tables" if tabled else "")] = planner.price(c)
    for c in planner.settings:
        if c.pp > 1 and c.dp == 1 and c.state is StateHome.DEVICE and f"pp {c.pp}" not in out:
            out[f"pp {c.pp}"] = planner.price(c)
        if c.tp > 1 and c.state is StateHome.DEVICE and f"tp {c.tp}" not in out:
            out[f"tp {c.tp}"] = planner.price(c)
    if optimizer is OptimizerKind.ADAMW:
        out[f"dp {WORLD}, state on the host"] = planner.price(Candidate(dp=WORLD, state=StateHome.HOST, offload_ratio=1.0,
                                                                        tables=places[0]))
        out[f"dp {WORLD}, half the state on the host"] = planner.price(Candidate(dp=WORLD, state=StateHome.PARTIAL,
                                                                                 offload_ratio=0.5, tables=places[0]))
    dp = Candidate(dp=WORLD, micro_batches=m, tables=places[0])
    dense = [n for i, n in enumerate(planner.cost.names()) if UnitChoice(Target.HOST) in planner.cost.options(i, dp)]
    if dense and planner.untraceable is None:
        half = {n: UnitChoice(Target.HOST) for n in dense[: max(1, len(dense) // 2)]}
        out[f"dp {WORLD}, first half on the host"] = planner.price(dp, half)
        sharded = Candidate(dp=WORLD, zero=3, micro_batches=m, tables=places[0])  # FSDP2 over the device units around them
        if sharded in planner.settings:
            out[f"dp {WORLD}, ZeRO 3, first half on the host"] = planner.price(sharded, half)
    streamable = [n for i, n in enumerate(planner.cost.names()) if STREAMED in planner.cost.options(i, dp)]
    if streamable:
        out[f"dp {WORLD}, first half's weights streamed"] = planner.price(dp, {n: STREAMED for n in
                                                                                 streamable[: max(1, len(streamable) // 2)]})
    return out


def _run(rank: int, n: int, name: str, paths: list[str], rounds: int, threads: int, port: int, out: dict) -> None:
    """One rank: every plan applied to a fresh model and stepped, ``rounds`` times over."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(threads)
    from hetero.planner.apply import apply
    from hetero.planner.meter import measure_step

    model = models()[name]
    best: dict[str, float] = {}
    for _ in range(rounds):
        for path in paths:
            torch.manual_seed(0)
            plan = Plan.load(path)
            applied = apply(model.build(), plan, model.config, model.sparse, loss_fn=model.loss)
            dist.barrier()
            got = torch.tensor([measure_step(applied, model.inputs, model.target, model.loss, steps=model.steps,
                                             warmup=3).seconds])
            dist.all_reduce(got, op=dist.ReduceOp.MAX)  # the slower rank's: the step ends when both have
            best[path] = min(best.get(path, float("inf")), float(got))
            del applied
    if rank == 0:
        out.update(best)
    dist.destroy_process_group()


def run_model(name: str, model: Model, rounds: int, threads: int) -> dict:
    start = time.perf_counter()
    planner = Planner(model.build(), model.inputs, world_size=WORLD, loss_fn=lambda o: model.loss(o, model.target),
                      optimizer=model.optimizer, sparse_optimizers=model.sparse)
    chosen = planner.plan()
    plan_seconds = time.perf_counter() - start
    plans = grid(planner, model.optimizer)
    everything = {**plans, "chosen": chosen}
    with tempfile.TemporaryDirectory() as tmp:  # one file per distinct plan: the chosen one may be a grid plan
        files = {key(p): str(p.save(Path(tmp) / f"{i}.json")) for i, p in enumerate(everything.values())}
        paths = {n: files[key(p)] for n, p in everything.items()}
        measured = spawn_ranks(_run, WORLD, name, list(files.values()), rounds, threads)
    rows = [{"plan": n, "mesh": p.candidate.describe()["mesh"], "predicted_s": p.predicted.seconds,
             "measured_s": measured[paths[n]]} for n, p in everything.items()]
    for r in rows:
        r["error"] = abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"]
        print(f"{name}: {r['plan']:32s} predicted {r['predicted_s']:.4f} s, measured {r['measured_s']:.4f} s", file=sys.stderr)
    best = min(rows[:-1], key=lambda r: r["measured_s"])
    return {"chosen": chosen.candidate.describe(), "host_units": chosen.host_units(), "plan_seconds": plan_seconds,
            "best_grid_plan": best["plan"], "best_grid_s": best["measured_s"], "chosen_s": rows[-1]["measured_s"],
            "within_5pct_of_best": rows[-1]["measured_s"] <= 1.05 * best["measured_s"],
            "chosen_is_new": key(chosen) not in {key(p) for p in plans.values()}, "plans": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt,mnist_mlp,resnet50,dlrm")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    start = time.perf_counter()
    threads = max(1, (os.cpu_count() or WORLD) // WORLD)
    torch.set_num_threads(threads)  # a rank's: the planner calibrates (and caches) at this count
    calibration = calibrate()  # measured once per machine and thread count (cached); its time is not planning's
    catalogue = models()
    per_model = {name: run_model(name, catalogue[name], args.rounds, threads) for name in args.models.split(",")}
    errors = [r["error"] for m in per_model.values() for r in m["plans"][:-1] + [m["plans"][-1]] * m["chosen_is_new"]]
    emit("planner_ranks", {
        "machine": calibration.machine, "world_size": WORLD, "threads_per_rank": threads,
        "median_prediction_error": statistics.median(errors), "worst_prediction_error": max(errors),
        "fraction_within_5pct_of_best": sum(m["within_5pct_of_best"] for m in per_model.values()) / len(per_model),
        "max_plan_seconds": max(m["plan_seconds"] for m in per_model.values()),
        "plans_executed": len(errors),  # (distinct plans: a chosen grid plan counts once)
        "benchmark_seconds": time.perf_counter() - start, "models": per_model,
    })


if __name__ == "__main__":
    main()
