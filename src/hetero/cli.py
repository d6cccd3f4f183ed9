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
from hetero.cli_plan import apply_job_plan, build_model, dense_optimizer, job_plan, plan_job, \
    planning_batches
from hetero.data.stream import StreamBatches
from hetero.embedding import dense_parameters, host_tables, set_num_threads
from hetero.cli_parser import build_parser, check_train_args, parse_args, train_flags
from hetero.data.schema import plain_data
from hetero.jobfile import JobFile, read_job_file
from hetero.train.run_dir import check_run_dir, remove_run_files
from hetero.models.wide_deep import FeatureSlot, mlp_sharding_plan, pipeline_split_points
from hetero.optim import FTRLConfig, SparseOptimizerKind
from hetero.optim.host_state import storage_bytes
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
    return {k: plain_data(v) for k, v in sorted(vars(args).items())}


def _predict(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hetero predict`` on this process's rank (under torchrun: each rank its shard)."""
    failed = True
    try:
        reader = (read_job_file(args.config, train_flags(parser)).source.located(args.data_dir, args.cache_dir).reader
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
            out = prepare_cache(args, train_flags(parser))
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
