"""``hetero train``: the main job - Wide & Deep (or DLRM) on a file described by a job config
(``--config``: ``examples/movielens.toml`` is the demo's, ``examples/criteo.toml`` the Criteo
format; ``--stream``, ``--prepared``).
``hetero data prepare``: a job's data encoded once into a columnar cache (``hetero.data.prepare``).
``hetero predict``: a run's checkpoint scoring a file (``hetero.predict``).
``hetero checkpoint merge``: a sharded checkpoint into one integrated file (for inference).

Each component gets its own small config built from the flags; nothing else is shared.
The last line printed to stdout is the run's metrics as one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import linecache
import logging
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from hetero import parallel, ps
from hetero.data import (
    BatchConfig,
    Batches,
    FeatureRole,
)
from hetero.cli_data import job_data, prepare_cache
from hetero.cli_plan import add_plan_arguments, apply_job_plan, build_model, dense_optimizer, job_plan, plan_job, \
    planning_batches
from hetero.data.readers import ReaderConfig
from hetero.data.stream import StreamBatches
from hetero.embedding import dense_parameters, host_tables, set_num_threads
from hetero.jobfile import JobFile, read_job_file
from hetero.models.dlrm import DLRMConfig
from hetero.models.wide_deep import FeatureSlot, WideDeepConfig, mlp_sharding_plan, pipeline_split_points
from hetero.optim import FTRLConfig, SparseOptimizerKind
from hetero.optim.accounting import storage_bytes
from hetero.parallel import DataParallelConfig
from hetero.parallel.env import set_data_parallel_group
from hetero.parallel.parallelize import ParallelPlan, parallelize
from hetero.parallel.pipeline import pipeline
from hetero.parallel.pipeline_plan import PipelineConfig, Schedule
from hetero.parallel.recompute import apply_recompute
from hetero.parallel.zero import ZeroConfig, local_elements, zero_optimizer
from hetero.placement import Target, resolve_device
from hetero.predict import predict
from hetero.record import ModelRecord, RunRecord
from hetero.ps import PSConfig, PSMode
from hetero.train import CheckpointFormat, TrainConfig, Trainer
from hetero.train.trainer import weighted_bce

log = logging.getLogger("hetero")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _train_arguments(t: argparse.ArgumentParser, train: bool = True) -> None:
    """``hetero train``'s flags (``hetero plan`` takes them too, ``--plan`` apart: the job it plans)."""
    g = t.add_argument_group("data")
    g.add_argument("--config", type=Path, help="a job config file (TOML): the data, its schema, and any of these "
                   "flags by name; flags given here override it (see hetero.jobfile; examples/movielens.toml)")
    g.add_argument("--data-path", type=Path, help="the data file (instead of the job file's path)")
    g.add_argument("--data-dir", type=Path, help="the directory the job file's relative paths are in (default: the "
                   "fetched data set's, else the current directory)")
    g.add_argument("--stream", action="store_true", help="a job file's data streamed from disk in blocks, not read "
                   "into memory (needs valid_path and test_path in [data]; see hetero.data.stream)")
    g.add_argument("--prepared", type=Path, help="train on a cache written by `hetero data prepare` (memory-mapped)")
    g.add_argument("--shuffle-window", type=int, default=1 << 17, help="--stream: rows shuffled together")
    g.add_argument("--cache-dir", type=Path, help="download cache (default $HETERO_CACHE or ~/.cache/hetero)")
    g.add_argument("--batch-size", type=int, default=256, help="global batch (split over the ranks under torchrun)")
    g.add_argument("--seed", type=int, default=0, help="seeds the split, the shuffling and the initialisation")
    g = t.add_argument_group("model")
    g.add_argument("--model", choices=["wide_deep", "dlrm"], default="wide_deep",
                   help="Wide & Deep (--hidden: its MLP) or DLRM (--bottom, --hidden: the top MLP)")
    g.add_argument("--bottom", type=_ints, default=DLRMConfig.bottom, help="DLRM: the bottom MLP's widths")
    g.add_argument("--embedding-dim", type=int, default=WideDeepConfig.embedding_dim, help="deep tables' row width")
    g.add_argument("--hidden", type=_ints, default=(256, 128), help="MLP widths, comma-separated")
    g.add_argument("--dropout", type=float, default=0.3, help="dropout after each hidden layer of the MLP")
    g = t.add_argument_group("optimizers")
    kinds = [k.value for k in SparseOptimizerKind]
    g.add_argument("--dense-lr", type=float, default=1e-3, help="learning rate of Adam on the device MLP (> 0)")
    g.add_argument("--deep-optimizer", choices=kinds, default="lazy_adam", help="sparse optimizer of the deep tables")
    g.add_argument("--deep-lr", type=float, default=1e-2, help="learning rate of the deep tables (> 0)")
    g.add_argument("--wide-optimizer", choices=kinds, default="ftrl", help="sparse optimizer of the wide tables")
    g.add_argument("--wide-lr", type=float, default=0.05, help="learning rate of the wide tables (> 0)")
    g.add_argument("--ftrl-l1", type=float, default=0.0, help="FTRL's L1 strength (>= 0)")
    g.add_argument("--ftrl-l2", type=float, default=1.0, help="FTRL's L2 strength (>= 0)")
    g = t.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=8, help="passes over the training split")
    g.add_argument("--run-dir", type=Path, default=Path("runs/wide_deep"), help="where the run's checkpoints, metrics "
                   "and plots go (one run per directory: see --resume, --overwrite)")
    g.add_argument("--resume", nargs="?", const="yes", choices=["yes", "auto"],
                   help="continue from RUN_DIR's checkpoint; 'auto': if it exists (for torchrun --max-restarts)")
    g.add_argument("--overwrite", action="store_true", help="start a new run in a RUN_DIR that holds another run's "
                   "checkpoint: its files (checkpoints, metrics, plots, plan) are removed once the job's checks pass")
    g.add_argument("--checkpoint-format", choices=[f.value for f in CheckpointFormat],
                   help="integrated (default): RUN_DIR/checkpoint.pt, written whole by rank 0; sharded (the default with "
                        "--ps-servers): RUN_DIR/checkpoint.dcp, each rank writing its part (torch.distributed.checkpoint); "
                        "both resume at any world size")
    g.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: each epoch)")
    g.add_argument("--max-steps", type=int, help="stop after this many steps in total")
    g.add_argument("--patience", type=int, default=0, help="stop after this many epochs without a better validation "
                   "AUC (0: never early); implies --keep-best")
    g.add_argument("--keep-best", action="store_true", help="also keep the best epoch's checkpoint (best.pt) and score "
                   "the test split with it")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--prefetch", action="store_true", help="prepare the next batch's lookups on a worker thread")
    g.add_argument("--threads", type=int, help="threads of the host embedding kernels (default: torch's)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                   help="ZeRO for the dense part over the data-parallel ranks: 1 Adam states, 2 + gradients, "
                        "3 + parameters (host tables keep their own sparse exchange)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages, one per rank (under torchrun --nproc-per-node "
                   "PP): stage 0 the host tables and the first MLP layers, the later stages the rest of the MLP")
    g.add_argument("--schedule", choices=[s.value for s in Schedule if not s.interleaved],
                   default=Schedule.ONE_F_ONE_B.value, help="pipeline schedule (with --pp)")
    g.add_argument("--micro-batches", type=int, help="micro-batches per batch (with --pp; default: --pp)")
    g.add_argument("--tp", type=int, default=1, help="operator-parallel ranks for the deep MLP (under torchrun "
                   "--nproc-per-node TP; the tables stay replicated on each host)")
    g.add_argument("--table-sharding", choices=["replicated", "row"], default="replicated",
                   help="under torchrun: every rank holds whole tables, or a 1/N block of each table's rows")
    g = t.add_argument_group("parameter server (under torchrun: the last N processes serve the tables)")
    g.add_argument("--ps-servers", type=int, default=0, help="server processes (0: no parameter server)")
    g.add_argument("--ps-mode", choices=[m.value for m in PSMode], default="sync",
                   help="sync: equal to one process on the global batch; async: pushes applied on arrival; bounded: "
                        "async with a worker row cache of at most --ps-staleness steps")
    g.add_argument("--ps-staleness", type=int, default=0, help="bounded mode: steps a pulled row may be reused")
    g.add_argument("--ps-server-memory-mb", type=float, default=0.0,
                   help="each server's memory budget for its shard of rows and optimizer state (0: unlimited)")
    g.add_argument("--ps-timeout", type=float, default=60.0, help="seconds a worker waits for a server's answer")
    g = t.add_argument_group("planning (hetero.plan)")
    if train:
        g.add_argument("--plan", help="auto: plan the job for this machine and world size (rank 0 plans, every rank "
                       "applies it: dense optimizer state, recompute, table placement, ZeRO); or a plan file from "
                       "`hetero plan`. The plan is written to RUN_DIR/plan.json")
    add_plan_arguments(g)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    defaults = argparse.ArgumentDefaultsHelpFormatter  # --help shows every default
    t = sub.add_parser("train", help="train Wide & Deep with host-resident embedding tables", formatter_class=defaults)
    _train_arguments(t)
    pl = sub.add_parser("plan", help="plan a job (hetero.plan): placement and parallel strategy under memory budgets",
                        formatter_class=defaults)
    _train_arguments(pl, train=False)
    g = pl.add_argument_group("the plan")
    g.add_argument("--world-size", type=int, default=1, help="ranks the job will run on")
    g.add_argument("--out", type=Path, default=Path("plan.json"), help="the plan file to write")
    d = sub.add_parser("data", help="data tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    dp = dsub.add_parser("prepare", help="encode a job file's data once into a columnar cache (hetero.data.prepare)",
                        formatter_class=defaults)
    dp.add_argument("--config", type=Path, required=True, help="the job config file: its [data] and [schema]")
    dp.add_argument("--out", type=Path, required=True, help="the cache directory to write (must not exist)")
    dp.add_argument("--data-path", type=Path, help="the file, if [data] names none")
    dp.add_argument("--data-dir", type=Path, help="the directory the job file's relative paths are in")
    dp.add_argument("--cache-dir", type=Path, help="download cache (default $HETERO_CACHE or ~/.cache/hetero)")
    dp.add_argument("--seed", type=int, default=0, help="seeds a random split")
    pr = sub.add_parser("predict", help="score a schema-described file with a run's checkpoint (hetero.predict)",
                        formatter_class=defaults)
    pr.add_argument("--checkpoint", type=Path, required=True, help="an integrated checkpoint of a `hetero train "
                    "--config` run (best.pt, checkpoint.pt, a merged file): it holds the model, encoding and reader "
                    "settings the run used")
    pr.add_argument("--data", type=Path, required=True, help="the file to score (with the schema's columns)")
    pr.add_argument("--out", type=Path, required=True, help="scores.parquet or scores.csv (score, and label when the "
                    "file has the label column: AUC and log loss are then printed)")
    pr.add_argument("--config", type=Path, help="a job config file to locate the run's side tables (joins); its "
                    "[data] reader settings must be the run's (by default the file is read as the run read its data)")
    pr.add_argument("--id-column", help="a column of --data copied into the scores beside each row's score (a key)")
    pr.add_argument("--data-dir", type=Path, help="the directory the job file's relative paths are in")
    pr.add_argument("--cache-dir", type=Path, help="download cache (default $HETERO_CACHE or ~/.cache/hetero)")
    pr.add_argument("--batch-size", type=int, default=8192, help="rows scored at a time")
    c = sub.add_parser("checkpoint", help="checkpoint tools")
    csub = c.add_subparsers(dest="action", required=True)
    m = csub.add_parser("merge", help="merge a sharded checkpoint (a checkpoint.dcp directory) into one integrated file",
                        formatter_class=defaults)
    m.add_argument("source", type=Path, help="the checkpoint.dcp directory")
    m.add_argument("output", type=Path, help="the integrated checkpoint file to write (atomically)")
    return p


def _train_flags(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """``hetero train``'s flags, each mapped to whether it takes a value (argparse keeps its
    actions in ``_actions``, the one place that lists them)."""
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    return {a.option_strings[-1]: a.nargs != 0 for a in train._actions if a.option_strings and a.dest != "help"}


def merge(source: Path, output: Path) -> Path:
    """Write the integrated checkpoint of the sharded checkpoint ``source`` to ``output``.

    Raises:
        CheckpointError: ``source`` is missing, incomplete (a shard missing or truncated) or unreadable.
    """
    from hetero.checkpoint import save_checkpoint
    from hetero.checkpoint.sharded import read_full
    from hetero.train.checkpointing import to_integrated

    return save_checkpoint(to_integrated(read_full(source)), output)


def _sparse_optimizer(kind: str, tables, lr: float, args):
    kind = SparseOptimizerKind(kind)
    if kind is SparseOptimizerKind.FTRL:
        return kind.optimizer(tables, FTRLConfig(lr=lr, l1=args.ftrl_l1, l2=args.ftrl_l2))
    return kind.optimizer(tables, kind.optimizer.Config(lr=lr))


def _operator_parallel_mesh(args: argparse.Namespace):  # noqa: ANN202 - a DeviceMesh or None
    """With ``--tp N`` > 1: the job's mesh, every rank operator-parallel (the data-parallel
    dimension is 1: each rank reads the whole batch, as ``DatasetStrategy.FULL_BATCH``)."""
    if args.tp == 1:
        return None
    if args.ps_servers or args.table_sharding == "row" or args.prefetch:
        raise ValueError("--tp works with replicated host tables: drop --ps-servers, --table-sharding row and --prefetch")
    if parallel.world_size() != args.tp:
        raise ValueError(f"--tp {args.tp} runs every rank operator-parallel: start torchrun --nproc-per-node {args.tp} "
                         f"(this job has {parallel.world_size()} ranks); data x operator parallel (a 2-D mesh) is "
                         f"hetero.parallel's (apply_sharding with batch slices), not yet hetero train's")
    mesh = parallel.build_mesh(parallel.MeshConfig(tp=args.tp))
    # The data-parallel group is this rank alone: no DDP, no sparse-gradient exchange, every rank
    # the whole batch; the tables stay identical because every rank applies the same updates.
    set_data_parallel_group(mesh[parallel.MeshDim.DP.value].get_group())
    return mesh


def _pipeline_mesh(args: argparse.Namespace):  # noqa: ANN202 - a DeviceMesh
    """With ``--pp N`` > 1: the job's mesh, one pipeline stage per rank (the data-parallel
    dimension is 1: every rank reads the whole batch, the first stage's rank its features)."""
    others = [flag for flag, on in (("--tp", args.tp > 1), ("--zero", args.zero), ("--ps-servers", args.ps_servers),
                                    ("--table-sharding row", args.table_sharding == "row"), ("--prefetch", args.prefetch),
                                    ("--checkpoint-format sharded", args.checkpoint_format == "sharded")) if on]
    if others:
        raise ValueError(f"--pp runs the pipeline alone in hetero train (replicated tables, integrated checkpoints): "
                         f"drop {', '.join(others)}")
    if parallel.world_size() != args.pp:
        raise ValueError(f"--pp {args.pp} runs one stage per rank: start torchrun --nproc-per-node {args.pp} (this job "
                         f"has {parallel.world_size()} ranks); pipeline x data parallel is hetero.parallel's "
                         f"(pipeline over a pp x dp mesh), not yet hetero train's")
    micro = args.micro_batches or args.pp
    if args.batch_size % micro:
        raise ValueError(f"--micro-batches {micro} does not divide --batch-size {args.batch_size}: choose a batch size "
                         f"that is a multiple of the micro-batches")
    mesh = parallel.build_mesh(parallel.MeshConfig(pp=args.pp))
    set_data_parallel_group(mesh[parallel.MeshDim.DP.value].get_group())  # this rank alone: no DDP, no exchange
    return mesh


def build_trainer(args: argparse.Namespace, on_step=None, mesh=None,  # noqa: ANN001 - a DeviceMesh
                  job: JobFile | None = None) -> tuple[Trainer | None, Callable[[], None]]:
    """The trainer of this process (``None`` on a parameter server, which has served the job by
    the time this returns) and what writes the run's own files (``plan.json``,
    ``strategy.json``): called after a resume's checks, every rank (nothing is written before
    them). With ``mesh`` (``--tp``), the deep MLP is operator-parallel on it; with ``job``, its
    schema and data (``--config``). Nothing is written into ``args.run_dir`` here."""
    torch.manual_seed(args.seed)
    data = job_data(args, job)
    slots = [FeatureSlot(f.name, f.vocab_size, f.multi_hot, wide=f.role is not FeatureRole.DEEP,
                         deep=f.role is not FeatureRole.WIDE) for f in data.specs]
    # a parameter server runs no model: it keeps it on the host and leaves the accelerator alone
    device = torch.device("cpu") if ps.role() is ps.Role.SERVER else resolve_device(Target.DEVICE)
    model, model_config = build_model(args, slots, data.num_dense, device)
    plan = planned = strategy = None
    if args.plan:
        if isinstance(data.train, StreamBatches) or args.pp > 1 or args.tp > 1 or args.ps_servers:
            raise ValueError("--plan plans a data-parallel job on in-memory or prepared data: drop --stream (prepare a "
                             "cache: hetero data prepare), --pp, --tp and --ps-servers")
        plan = planned = job_plan(args, model, planning_batches(args, data.train))
        apply_job_plan(args, plan, model)  # the table placement and ZeRO stage it chose
        apply_recompute(model, plan.recompute_config())
    pipe = None
    if args.pp > 1:
        pp_config = PipelineConfig(Schedule(args.schedule), args.micro_batches or args.pp,
                                   split_points=pipeline_split_points(model, args.pp))
        pipe = pipeline(model, pp_config, mesh, weighted_bce)
        model = pipe.modules[0]  # this rank's stage: the host tables live in stage 0 only
        log.info("%s", pipe.plan)
    if args.prefetch and (args.table_sharding == "row" or args.ps_servers):
        raise ValueError("--prefetch works with replicated tables only; drop it or use --table-sharding replicated "
                         "without --ps-servers")
    if args.ps_servers:
        ps.shard_tables(model)  # before the optimizers: their state is allocated per shard, on the servers
    elif args.table_sharding == "row":
        parallel.shard_rows(model)
    tables = host_tables(model)
    parts = {"wide": (args.wide_optimizer, args.wide_lr), "deep": (args.deep_optimizer, args.deep_lr)}
    sparse = {part: _sparse_optimizer(kind, own, lr, args) for part, (kind, lr) in parts.items()
              if (own := {k: v for k, v in tables.items() if k.startswith(f"{part}.")})}  # (DLRM: no wide tables;
    # a later pipeline stage: none)
    if args.ps_servers:
        ps.start(model, sparse)  # memory budgets checked on every rank; a server serves here until the workers stop
        if ps.role() is ps.Role.SERVER:
            return None, lambda: None
    zero = ZeroConfig(args.zero, units=("mlp",))
    if args.zero and args.ps_servers:
        raise ValueError("--zero shards the dense part over the data-parallel ranks; a parameter-server job's "
                         "workers are not the whole mesh: drop --zero or --ps-servers")
    if args.zero and mesh is None:
        mesh = parallel.build_mesh(parallel.MeshConfig())  # every rank data-parallel
    if mesh is not None and pipe is None:  # operator sharding, then ZeRO (FSDP2 over dp; the host tables are left out)
        plan = ParallelPlan(sharding=mlp_sharding_plan(model, args.tp) if args.tp > 1 else None, zero=zero)
        layout = parallelize(model, plan, mesh)
        if layout:
            local = storage_bytes(model.mlp.parameters())  # DTensors count their local shards
            whole = sum(p.numel() * p.element_size() for p in model.mlp.parameters())
            log.info("hetero: deep MLP operator-parallel over %d ranks: %d parameters sharded, %d of %d bytes per rank",
                     args.tp, sum(any(pl.is_shard() for pl in v) for v in layout.values()), local, whole)
            strategy = (mesh, layout)  # written with the run's files, after a resume's checks
    # foreach=False under --tp: the parameters mix DTensor shards and plain tensors
    foreach = None if mesh is None or args.tp == 1 else False
    if plan is not None and mesh is None:  # where the plan puts the dense optimizer's state
        named = [(n, p) for n, p in model.named_parameters() if p in set(dense_parameters(model))]
        dense = dense_optimizer(plan, named, args.dense_lr)
    else:
        dense = (zero_optimizer(dense_parameters(model), torch.optim.Adam, zero, mesh, lr=args.dense_lr, foreach=foreach)
                 if mesh is not None and pipe is None else torch.optim.Adam(dense_parameters(model), lr=args.dense_lr))
    if args.zero:
        log.info("hetero: ZeRO stage %d over %d data-parallel ranks: this rank updates %d of %d dense parameter "
                 "elements", args.zero, parallel.world_size(), local_elements(dense),
                 sum(p.numel() for p in dense_parameters(model)))
    n_rows = sum(t.config.num_embeddings for t in tables.values())
    where = f"on {args.ps_servers} parameter servers" if args.ps_servers else f"on this host ({args.table_sharding})"
    log.info("hetero: %s training samples; %d host tables, %d rows, %.1f MB %s; MLP on %s",
             "streamed" if isinstance(data.train, StreamBatches) else len(data.train), len(tables), n_rows,
             sum(t.weight.numel() * t.weight.element_size() for t in tables.values()) / 1e6, where, device)
    fmt = args.checkpoint_format or ("sharded" if args.ps_servers else "integrated")
    if args.patience < 0:
        raise ValueError(f"--patience {args.patience}: give 0 (never stop early) or a number of epochs")
    config = TrainConfig(epochs=args.epochs, checkpoint_every=args.checkpoint_every, max_steps=args.max_steps,
                         patience=args.patience, keep_best=args.keep_best,
                         progress=not args.no_progress, prefetch=args.prefetch, checkpoint_format=CheckpointFormat(fmt),
                         data_parallel=DataParallelConfig(dense_sharded=args.zero >= 2))
    set_num_threads(args.threads)
    # what reads the run back (predict, a resume's checks), written inside every checkpoint
    record = RunRecord(ModelRecord(args.model, dataclasses.asdict(model_config), data.num_dense), data.encoding,
                       data.reader, _plain_config(args), None if planned is None else planned.to_dict())
    batches = data.train if isinstance(data.train, StreamBatches) else Batches(
        data.train, BatchConfig(batch_size=args.batch_size, shuffle=True, seed=args.seed, rank=parallel.rank(),
                                world_size=parallel.world_size()))
    return Trainer(model, dense, sparse, batches, data.valid, data.test, config, args.run_dir, on_step=on_step,
                   pipeline=pipe, record=record.to_state()), functools.partial(_write_run_files, args.run_dir, planned,
                                                                             strategy)


def _write_run_files(run_dir: Path, plan, strategy) -> None:  # noqa: ANN001 - a Plan, a (mesh, layout) pair
    """The run's own readable files (every rank calls it: the strategy's write is collective)."""
    if plan is not None and parallel.global_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        plan.save(run_dir / "plan.json")
    if strategy is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        parallel.save_strategy(run_dir / "strategy.json", *strategy)  # the resolved layout


def _plain_config(args: argparse.Namespace) -> dict:
    """The resolved command line (job file and flags) as JSON-able data, for the run record."""
    def plain(v):  # noqa: ANN001, ANN202
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return v

    return {k: plain(v) for k, v in sorted(vars(args).items())}


RUN_FILES = ("checkpoint.pt", "checkpoint.dcp", "best.pt", "best.dcp", "metrics.json", "losses.csv", "curves.png",
             "plan.json", "strategy.json")  # what a run writes into its directory


def check_run_dir(run_dir: Path, resume: str | None, overwrite: bool) -> None:
    """Check, before anything is read or written, that ``run_dir`` can take this run: a directory
    (or creatable), writable, and not holding another run's checkpoint unless the job resumes it
    or overwrites it.

    Raises:
        ValueError: naming the directory and the fix.
    """
    if resume and overwrite:
        raise ValueError("--resume continues the run in --run-dir and --overwrite replaces it: give one")
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir} is a file: give a directory")
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--run-dir {run_dir} cannot be created: {existing} is a file; give a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--run-dir {run_dir} is not writable ({existing} denies this user): give a directory you can "
                         f"write")
    held = [name for name in RUN_FILES[:4] if (run_dir / name).exists()]
    if held and not resume and not overwrite:
        raise ValueError(f"--run-dir {run_dir} holds another run ({held[0]}): continue it with --resume, replace it with "
                         f"--overwrite, or give another --run-dir")


def remove_run_files(run_dir: Path) -> None:
    """Remove a previous run's files from ``run_dir`` (``--overwrite``; nothing else in it)."""
    for name in RUN_FILES:
        for path in (run_dir / name, run_dir / f"{name}.old", run_dir / f"{name}.tmp"):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


def _predict(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hetero predict`` on this process's rank (under torchrun: each rank its shard)."""
    failed = True
    try:
        reader = (read_job_file(args.config, _train_flags(parser)).source.located(args.data_dir, args.cache_dir).reader
                  if args.config else None)  # None: the run's own reader settings, from its checkpoint
        parallel.init(parallel.DistConfig(backend="gloo"))  # scoring runs on the host: gloo for the barrier
        got = predict(args.checkpoint, args.data, args.out, reader, args.batch_size, parallel.global_rank(),
                      parallel.world_size(), args.id_column)
        failed = False
    except Exception as e:  # noqa: BLE001 - reported, then the exit code says it failed
        report_error(e)
        return 1
    finally:
        parallel.shutdown(clean=not failed)
    if got is not None:
        out, metrics = got
        print(json.dumps({"scores": str(out), "checkpoint": str(args.checkpoint), "data": str(args.data), **metrics},
                         allow_nan=False))
    return 0


def report_error(e: BaseException, *own: Path) -> None:
    """One line for an error hetero raised itself (bad input, a bad checkpoint, a NaN loss: the
    message names the thing and the fix); the full traceback for anything else (a CUDA or NCCL
    failure, a bug), which a one-liner would hide. ``own``: more source files or directories
    whose ``raise`` statements count as hetero's (an example script's)."""
    if _raised_by(e, (_PACKAGE, *(p.resolve() for p in own))):
        print(f"hetero: error: {e}", file=sys.stderr)
    else:
        traceback.print_exception(e, file=sys.stderr)


def run_main(main: Callable[[], object], script: str) -> None:
    """Run a script's ``main()`` (the examples'): on an error, :func:`report_error` (the script's
    own ``raise`` statements count as hetero's) and exit with status 1."""
    try:
        main()
    except Exception as e:  # noqa: BLE001 - reported, then the exit status says it failed
        report_error(e, Path(script))
        sys.exit(1)


def _raised_by(e: BaseException, sources: tuple[Path, ...]) -> bool:
    """Whether ``e`` comes from a ``raise`` statement in ``sources``: the innermost frame of its
    traceback is there, at a ``raise`` (a failing torch call made from hetero's code has its
    innermost Python frame there too, but at the call)."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    where = Path(filename).resolve()
    if not any(where == src or where.is_relative_to(src) for src in sources):
        return False
    return linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise")


_PACKAGE = Path(__file__).resolve().parent


def parse_args(argv: list[str], parser: argparse.ArgumentParser | None = None
               ) -> tuple[argparse.Namespace, JobFile | None]:
    """The command line ``argv`` (without the program's name) and, for ``train --config``, its
    job file, whose ``[train]`` flags come first so the command line's win.

    Raises:
        FileNotFoundError, ValueError: the job file is missing or bad (see :func:`read_job_file`).
    """
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if args.command not in ("train", "plan") or args.config is None:
        return args, None
    job = read_job_file(args.config, _train_flags(parser))
    file_argv = list(job.argv)
    if args.command == "plan" and "--plan" in file_argv:  # what `hetero plan` makes: a train flag, not its own
        at = file_argv.index("--plan")
        del file_argv[at : at + 2]
    at = argv.index(args.command) + 1  # the file's flags first: the command line's, after them, win
    return parser.parse_args([*argv[:at], *file_argv, *argv[at:]]), job


# flag -> (lowest value, whether the lowest is allowed itself); checked for train and plan
_BOUNDS = {
    "dense_lr": (0.0, False), "deep_lr": (0.0, False), "wide_lr": (0.0, False), "ftrl_l1": (0.0, True),
    "ftrl_l2": (0.0, True), "dropout": (0.0, True), "epochs": (1, True), "batch_size": (1, True),
    "embedding_dim": (1, True), "checkpoint_every": (0, True), "max_steps": (1, True), "patience": (0, True),
    "pp": (1, True), "tp": (1, True), "micro_batches": (1, True), "threads": (1, True), "ps_servers": (0, True),
    "ps_staleness": (0, True), "ps_server_memory_mb": (0.0, True), "ps_timeout": (0.0, False),
    "shuffle_window": (1, True),
}


def check_train_args(args: argparse.Namespace) -> None:
    """Check the job's numbers before anything runs: learning rates positive (a learning rate of
    0 trains nothing, silently; FTRL divides by it), counts and sizes in range.

    Raises:
        ValueError: naming the flag, its job-file key, the value and the range.
    """
    for key, (low, inclusive) in _BOUNDS.items():
        value = getattr(args, key, None)
        if value is None or isinstance(value, bool):
            continue
        if value < low or (value == low and not inclusive) or value != value:  # (NaN too)
            flag = "--" + key.replace("_", "-")
            bound = f">= {low}" if inclusive else f"> {low}"
            raise ValueError(f"{flag} (job file [train] {key}) = {value}: give a value {bound}")
    if args.dropout >= 1:
        raise ValueError(f"--dropout (job file [train] dropout) = {args.dropout}: give a value in [0, 1)")
    for key in ("hidden", "bottom"):
        if any(w < 1 for w in getattr(args, key, ())):
            raise ValueError(f"--{key} (job file [train] {key}) = {list(getattr(args, key))}: give widths >= 1")


def main(argv: list[str] | None = None, on_step=None) -> int:
    """Run the command line; ``on_step`` (see :class:`Trainer`) is for embedding callers."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, job = parse_args(argv, parser)
        if args.command in ("train", "plan"):
            check_train_args(args)
    except (OSError, ValueError) as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.command == "data":
        try:
            out = prepare_cache(args, _train_flags(parser))
        except Exception as e:  # noqa: BLE001 - reported, then the exit code says it failed
            report_error(e)
            return 1
        print(json.dumps({"prepared": str(out), **json.loads((out / "manifest.json").read_text())["splits"]["train"]}))
        return 0
    if args.command == "predict":
        return _predict(args, parser)
    if args.command == "plan":
        try:
            out = plan_job(args, job)
        except Exception as e:  # noqa: BLE001 - reported, then the exit code says it failed
            report_error(e)
            return 1
        print(json.dumps({"plan": str(out)}))
        return 0
    if args.command == "checkpoint":
        try:
            out = merge(args.source, args.output)
        except Exception as e:  # noqa: BLE001 - reported, then the exit code says it failed
            report_error(e)
            return 1
        print(json.dumps({"merged": str(args.source), "checkpoint": str(out)}))
        return 0
    rank, failed, trainer = 0, True, None
    try:
        # torchrun's environment, if any; a single process otherwise. A parameter-server job's
        # default group is gloo: its servers use no accelerator (the workers' group may be NCCL).
        parallel.init(parallel.DistConfig(backend="gloo") if args.ps_servers else parallel.DistConfig())
        if args.ps_servers:
            ps.init(PSConfig(num_servers=args.ps_servers, mode=PSMode(args.ps_mode), staleness=args.ps_staleness,
                             server_memory_bytes=int(args.ps_server_memory_mb * 2**20), timeout_s=args.ps_timeout))
        check_run_dir(args.run_dir, args.resume, args.overwrite)
        mesh = _pipeline_mesh(args) if args.pp > 1 else _operator_parallel_mesh(args)
        rank = parallel.global_rank()
        if rank != 0:  # one voice per job: the other ranks only warn
            logging.getLogger("hetero").setLevel(logging.WARNING)
        trainer, write_run_files = build_trainer(args, on_step, mesh, job)
        if trainer is None:  # a parameter server: the workers are done
            failed = False
            return 0
        if args.resume == "yes" or (args.resume == "auto" and trainer.has_checkpoint()):
            trainer.resume()  # checks the checkpoint against this run before it loads anything
        elif args.overwrite and rank == 0:
            remove_run_files(args.run_dir)  # every check has passed: the old run's files go (rank 0 writes them all)
        write_run_files()
        metrics = trainer.fit()
        failed = False
    except Exception as e:  # noqa: BLE001 - reported, then the exit code says it failed
        report_error(e)
        return 1  # under torchrun --max-restarts, a failed rank makes the job restart from the checkpoint
    finally:
        trainer = None  # release the DDP wrapper before its process group goes (see parallel.shutdown)
        ps.shutdown(clean=not failed)  # a parameter-server worker: tell the servers it is done
        parallel.shutdown(clean=not failed)
    if rank == 0:
        print(json.dumps({k: v for k, v in metrics.items() if k != "history"}, allow_nan=False))  # null, never NaN
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
