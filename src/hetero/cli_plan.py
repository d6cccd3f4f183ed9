"""The command line's planning side: ``hetero plan`` and ``hetero train --plan auto|FILE`` for the
main job's model (Wide & Deep or DLRM on a job file's data). Only the CLI calls this; nothing
below it sees ``argparse``.

The plan is made on rank 0 from the first training batch (and a few more for the tables' id
statistics) and broadcast, so every rank applies the same one; what the main job applies of it:
the dense optimizer's state (torch's Adam, ``HostAdamW`` or ``PartialOffloadAdamW``), the units
that recompute, and over several ranks the host tables' placement (replicated or row-sharded)
and the ZeRO stage. The main job trains one pass per batch (``micro_batches=(1,)``: bags cannot
be cut by rows) and its units stay on the device (its forward is not traceable by torch.fx).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetero import parallel
from hetero.cli_data import job_data
from hetero.data.stream import StreamBatches
from hetero.data.tabular import BatchConfig, Batches, FeatureRole, Rows
from hetero.jobfile import JobFile
from hetero.models.dlrm import DLRM, DLRMConfig
from hetero.models.wide_deep import FeatureSlot, WideDeep, WideDeepConfig
from hetero.placement import Target, resolve_device
from hetero.optim import SparseOptimizerKind
from hetero.planner.calibration import machine_key
from hetero.planner.optimizers import OptimizerConfig, device_optimizer
from hetero.planner.plan import Plan
from hetero.planner.space import OptimizerKind, TablePlacement

log = logging.getLogger("hetero")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"500MB"``, ``"1.5g"``, ``"1000000"`` as bytes.

    Raises:
        argparse.ArgumentTypeError: not a size (naming the units).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give a number of bytes with a unit of "
                                         f"{sorted(u for u in _UNITS if u)} (e.g. 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_plan_arguments(g: argparse._ArgumentGroup) -> None:
    """The budget flags of ``hetero train --plan`` and ``hetero plan``."""
    g.add_argument("--device-memory", type=parse_bytes, help="device budget per rank for --plan auto (e.g. 2GiB; "
                   "default: unlimited)")
    g.add_argument("--host-memory", type=parse_bytes, help="host budget per rank for --plan auto (default: unlimited)")


def build_model(args: argparse.Namespace, slots: list[FeatureSlot], num_dense: int,
                device: torch.device) -> tuple[torch.nn.Module, WideDeepConfig | DLRMConfig]:
    """The main job's model (``--model``) and its config.

    Raises:
        ValueError: DLRM with flags that split Wide & Deep's MLP.
    """
    if args.model == "dlrm":
        for flag, used in (("--pp", args.pp > 1), ("--tp", args.tp > 1), ("--zero", args.zero)):
            if used:
                raise ValueError(f"{flag} splits Wide & Deep's MLP; --model dlrm trains data-parallel: drop {flag}")
        config = DLRMConfig(embedding_dim=args.embedding_dim, bottom=args.bottom, top=args.hidden)
        return DLRM(slots, num_dense, config).to(device), config
    config = WideDeepConfig(embedding_dim=args.embedding_dim, hidden=args.hidden, dropout=args.dropout)
    return WideDeep(slots, num_dense, config).to(device), config


def planning_batches(args: argparse.Namespace, rows: Rows) -> Batches:
    """Global batches of the training rows in file order: what the planner captures."""
    return Batches(rows, BatchConfig(batch_size=args.batch_size, shuffle=False))


def plan_job(args: argparse.Namespace, job: JobFile | None) -> Path:
    """``hetero plan``: the job's plan for ``--world-size`` ranks, printed and written to ``--out``."""
    torch.manual_seed(args.seed)
    data = job_data(args, job)
    if isinstance(data.train, StreamBatches):
        raise ValueError("hetero plan captures in-memory or prepared data: drop --stream (or prepare a cache)")
    slots = [FeatureSlot(f.name, f.vocab_size, f.multi_hot, wide=f.role is not FeatureRole.DEEP,
                         deep=f.role is not FeatureRole.WIDE) for f in data.specs]
    model, _ = build_model(args, slots, data.num_dense, resolve_device(Target.DEVICE))
    plan = _make_plan(args, model, planning_batches(args, data.train), args.world_size)
    print(plan, file=sys.stderr)
    return plan.save(args.out)


def example_batches(batches: Batches, count: int = 4) -> list[tuple[Any, ...]]:
    """The first ``count`` batches of an epoch as the model's inputs ``(features, dense)``."""
    out = []
    for b in batches.epoch(0):
        out.append(((dict(b.features), b.dense), b.label))
        if len(out) == count:
            break
    return out


def job_plan(args: argparse.Namespace, model: nn.Module, batches: Batches) -> Plan:
    """``--plan auto``: planned on rank 0 for this job's world size, broadcast to every rank;
    ``--plan FILE``: read (every rank). Logged (the CLI writes it to ``RUN_DIR/plan.json`` once a
    resume's checks pass).

    Raises:
        ValueError: a plan file for another model or world size; as :func:`hetero.plan`.
    """
    world = parallel.world_size()
    if args.plan != "auto":
        plan = Plan.load(args.plan)
        check_plan_fits(plan, model, args.batch_size, world, args.plan)
    else:
        plan = _broadcast(_make_plan(args, model, batches, world) if parallel.global_rank() == 0 else None)
    if parallel.global_rank() == 0:
        log.info("%s", plan)
    return plan


def _machine(description: str) -> str:
    """A calibration's machine without its thread count (torchrun's ranks set their own)."""
    return "; ".join(part for part in description.split("; ") if not part.endswith(" threads"))


def check_plan_fits(plan: Plan, model: nn.Module, batch_size: int, world: int, where: str | Path) -> None:
    """Check that a loaded plan was made for this job: the model (its class and units), the
    global batch, the world size, the dense optimizer and this machine's calibration.

    Raises:
        ValueError: naming what differs, both values and the fix.
    """
    units = set(dict(model.named_modules()))
    missing = [u for u in plan.units if u not in units]
    here = _machine(machine_key()[1])
    for what, planned, ours in (("model", plan.model, type(model).__name__),
                                ("units", missing[:3], []),
                                ("global batch size (--batch-size)", plan.batch, batch_size),
                                ("world size (ranks)", plan.world_size, world),
                                ("dense optimizer", plan.optimizer.value, OptimizerKind.ADAM.value),
                                ("machine (its calibration)", _machine(plan.machine), here)):
        if planned != ours:
            raise ValueError(f"plan {where} was made for another {what}: {planned} in the plan, {ours} in this job: plan "
                             f"this job again (--plan auto, or hetero plan --world-size {world})")


def _make_plan(args: argparse.Namespace, model: nn.Module, batches: Batches, world: int) -> Plan:
    from hetero.planner.planner import Planner, PlannerConfig

    samples = example_batches(batches)
    (inputs, label), more = samples[0], tuple(s[0] for s in samples[1:])
    sparse = {"wide": SparseOptimizerKind(args.wide_optimizer), "deep": SparseOptimizerKind(args.deep_optimizer)}
    planner = Planner(model, inputs, world_size=world, optimizer=OptimizerKind.ADAM, sparse_optimizers=sparse,
                      loss_fn=lambda logits: torch.nn.functional.binary_cross_entropy_with_logits(logits, label),
                      sample_batches=more, config=PlannerConfig(micro_batches=(1,), device_tables=False))
    return planner.plan(args.device_memory, args.host_memory)


def _broadcast(plan: Plan | None) -> Plan:
    """Rank 0's plan on every rank (one object broadcast; a single process: itself)."""
    if parallel.world_size() == 1:
        assert plan is not None
        return plan
    box = [plan.to_dict() if plan is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Plan.from_dict(box[0])


def apply_job_plan(args: argparse.Namespace, plan: Plan, model: nn.Module) -> None:
    """The flags the plan decides (table placement, ZeRO stage), set from it; refused when the
    command line set them otherwise, or the plan decides what the main job does not run (tables
    or weights moved, dense units on the host, tp or pp: it would train otherwise than planned)."""
    c = plan.candidate
    moved = {"moves tables to the device": list(plan.device_tables),
             "puts dense units on the host": list(plan.placement_spec(model).modules),
             "streams units' weights from the host": plan.streamed_units(),
             "cuts operators or stages": [f"tp {c.tp}", f"pp {c.pp}"] if c.tp > 1 or c.pp > 1 else []}
    for what, names in moved.items():
        if names:
            raise ValueError(f"the plan {what} ({', '.join(names)}), which the main job does not run: plan it with "
                             f"hetero plan (or --plan auto), or apply it with hetero.apply")
    sharding = "row" if c.tables is TablePlacement.ROW_SHARDED else "replicated"
    for flag, given, planned in (("--table-sharding", args.table_sharding, sharding), ("--zero", args.zero, c.zero)):
        default = {"--table-sharding": "replicated", "--zero": 0}[flag]
        if given != default and given != planned:
            raise ValueError(f"{flag} {given} contradicts the plan ({planned}): drop {flag}, or drop --plan")
    args.table_sharding, args.zero = sharding, c.zero


def dense_optimizer(plan: Plan, named: list[tuple[str, nn.Parameter]], lr: float) -> torch.optim.Optimizer:
    """The main job's dense optimizer (Adam) where the plan puts its state - built as
    ``hetero.apply`` builds it (:func:`hetero.planner.optimizers.device_optimizer`): an
    offloaded state's HostAdamW averages its gradients over every rank itself, and the trainer
    leaves those parameters out of DDP."""
    return device_optimizer(named, plan, OptimizerConfig(lr=lr))
