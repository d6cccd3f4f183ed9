"""The command line's planning side: ``hetero plan`` and ``hetero train --plan auto|FILE`` for the
main job's model (Wide & Deep or DLRM on a job's data).

The plan is made on rank 0 from the first training batch (and a few more for the tables' id
statistics) and broadcast, so every rank applies the same one; what the main job applies of it:
the dense optimizer's state (torch's Adam, ``HostAdamW`` or ``PartialOffloadAdamW``), the units
that recompute, and over several ranks the host tables' placement (replicated or row-sharded)
and the ZeRO stage. The main job trains one pass per batch (``micro_batches=(1,)``: bags cannot
be cut by rows) and its units stay on the device (its forward is not traceable by torch.fx).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetero import parallel
from hetero.cli.data import job_data, with_prepared
from hetero.data.stream import StreamBatches
from hetero.data.tabular import BatchConfig, Batches, Feature, Rows
from hetero.config.job import JobConfig, Parallelism, TableSharding, TableStorage
from hetero.config.manager import locate
from hetero.models.build import ModelKind, build_model
from hetero.models.dlrm import DLRMConfig
from hetero.models.wide_deep import WideDeepConfig
from hetero.placement import Target, resolve_device
from hetero.planner.calibration import machine_key
from hetero.planner.optimizers import OptimizerConfig, device_optimizer
from hetero.planner.plan import Plan
from hetero.planner.space import OptimizerKind, TablePlacement
from hetero.planner.config import PlannerConfig
from hetero.planner.planner import Planner
from hetero.storage.config import SsdConfig

log = logging.getLogger("hetero")

def job_model(job: JobConfig, features: tuple[Feature, ...], num_dense: int,
              device: torch.device) -> tuple[torch.nn.Module, WideDeepConfig | DLRMConfig]:
    """The job's model (``model.name``) on ``device`` and its config.

    """
    m = job.model
    if m.name is ModelKind.DLRM:  # (the parallel keys that split Wide & Deep's MLP are refused by validate)
        config = DLRMConfig(embedding_dim=m.embedding_dim, bottom=m.bottom, top=m.hidden)
    else:
        config = WideDeepConfig(embedding_dim=m.embedding_dim, hidden=m.hidden, dropout=m.dropout)
    ssd = ssd_settings(job) if job.tables.storage is TableStorage.SSD else None  # (auto: those the plan chooses, later)
    return build_model(m.name, config, features, num_dense, ssd).to(device), config


def ssd_settings(job: JobConfig) -> SsdConfig:
    """The job's SSD tier (``[tables]``): each rank's tables in a directory of its own."""
    t = job.tables
    where = (t.ssd_path or job.checkpoint.run_dir / "ssd") / (f"rank{parallel.rank()}" if parallel.active() else "")
    return SsdConfig(where, cache_bytes=int(t.cache_mb * (1 << 20)), policy=t.cache_policy,
                     mapped_bytes=int(t.mapped_mb * (1 << 20)))


def planning_batches(job: JobConfig, rows: Rows) -> Batches:
    """Global batches of the training rows in file order: what the planner captures."""
    return Batches(rows, BatchConfig(batch_size=job.training.batch_size, shuffle=False))


def plan_job(job: JobConfig) -> Path:
    """``hetero plan``: the job's plan for ``planner.world_size`` ranks, printed and written to
    ``planner.out``."""
    torch.manual_seed(job.training.seed)
    data = job_data(with_prepared(locate(job)))
    if isinstance(data.train, StreamBatches):
        raise ValueError("hetero plan captures in-memory or prepared data: drop --stream (or prepare a cache)")
    model, _ = job_model(job, data.specs, data.num_dense, resolve_device(Target.DEVICE))
    plan = _make_plan(job, model, planning_batches(job, data.train), job.planner.world_size)
    print(plan, file=sys.stderr)
    return plan.save(job.planner.out)


def example_batches(batches: Batches, count: int = 4) -> list[tuple[Any, ...]]:
    """The first ``count`` batches of an epoch as the model's inputs ``(features, dense)``."""
    out = []
    for b in batches.epoch(0):
        out.append(((dict(b.features), b.dense), b.label))
        if len(out) == count:
            break
    return out


def job_plan(job: JobConfig, model: nn.Module, batches: Batches) -> Plan:
    """``--plan auto``: planned on rank 0 for this job's world size, broadcast to every rank;
    ``--plan FILE``: read (every rank). Logged (the CLI writes it to ``RUN_DIR/plan.json`` once a
    resume's checks pass).

    Raises:
        ValueError: a plan file for another model or world size; as :func:`hetero.plan`.
    """
    world = parallel.world_size()
    given = job.planner.plan
    if given != "auto":
        plan = Plan.load(given)
        check_plan_fits(plan, model, job.training.batch_size, world, given)
    else:
        plan = _broadcast(_make_plan(job, model, batches, world) if parallel.global_rank() == 0 else None)
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


def _make_plan(job: JobConfig, model: nn.Module, batches: Batches, world: int) -> Plan:

    samples = example_batches(batches)
    (inputs, label), more = samples[0], tuple(s[0] for s in samples[1:])
    sparse = {"wide": job.optimizer.wide, "deep": job.optimizer.deep}
    planner = Planner(model, inputs, world_size=world, optimizer=OptimizerKind.ADAM, sparse_optimizers=sparse,
                      loss_fn=lambda logits: torch.nn.functional.binary_cross_entropy_with_logits(
                          logits, label.to(logits.device)),  # (the capture runs the model on the device)
                      sample_batches=more, config=PlannerConfig(
                          micro_batches=(1,), device_tables=False,
                          ssd=ssd_settings(job) if job.tables.storage is TableStorage.AUTO else None))
    return planner.plan(job.planner.device_memory, job.planner.host_memory)


def _broadcast(plan: Plan | None) -> Plan:
    """Rank 0's plan on every rank (one object broadcast; a single process: itself)."""
    if parallel.world_size() == 1:
        assert plan is not None
        return plan
    box = [plan.to_dict() if plan is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Plan.from_dict(box[0])


def plan_changes(plan: Plan, job: JobConfig, model: nn.Module) -> JobConfig:
    """The job as the plan decides it: its table placement and ZeRO stage set from the plan.
    Refused when the job set them otherwise, or when the plan decides what the main job does
    not run (tables or weights moved, dense units on the host, tp or pp: it would train
    otherwise than planned).

    Raises:
        ValueError: naming what the plan decides and the key that contradicts it.
    """
    c = plan.candidate
    moved = {"moves tables to the device": list(plan.device_tables),
             "puts dense units on the host": list(plan.placement_spec(model).modules),
             "streams units' weights from the host": plan.streamed_units(),
             "cuts operators or stages": [f"tp {c.tp}", f"pp {c.pp}"] if c.tp > 1 or c.pp > 1 else []}
    for what, names in moved.items():
        if names:
            raise ValueError(f"the plan {what} ({', '.join(names)}), which the main job does not run: plan it with "
                             f"hetero plan (or --plan auto), or apply it with hetero.apply")
    if plan.ssd_tables and job.tables.storage is not TableStorage.AUTO:
        raise ValueError(f"the plan puts tables on the SSD tier ({', '.join(plan.ssd_tables)}) and tables.storage is "
                         f"{job.tables.storage.value}: set tables.storage = auto (--table-storage auto), or plan again")
    p, default = job.parallelism, Parallelism()
    sharding = TableSharding.ROW if c.tables is TablePlacement.ROW_SHARDED else TableSharding.REPLICATED
    # (key, the job's value, its default, the plan's), values as the job file writes them
    for key, given, unset, planned in (("table_sharding", p.table_sharding.value, default.table_sharding.value,
                                        sharding.value), ("zero", p.zero, default.zero, c.zero)):
        if given != unset and given != planned:
            raise ValueError(f"parallelism.{key} = {given} contradicts the plan ({planned}): drop it, or drop --plan")
    return dataclasses.replace(job, parallelism=dataclasses.replace(p, table_sharding=sharding, zero=c.zero))


def dense_optimizer(plan: Plan, named: list[tuple[str, nn.Parameter]], lr: float) -> torch.optim.Optimizer:
    """The main job's dense optimizer (Adam) where the plan puts its state - built as
    ``hetero.apply`` builds it (:func:`hetero.planner.optimizers.device_optimizer`): an
    offloaded state's HostAdamW averages its gradients over every rank itself, and the trainer
    leaves those parameters out of DDP."""
    return device_optimizer(named, plan, OptimizerConfig(lr=lr))
