"""``hetero train``: the main job - Wide & Deep (or DLRM) on the data a
:class:`~hetero.config.job.JobConfig` describes (``examples/movielens.toml`` is the demo's,
``examples/criteo.toml`` the Criteo format), in memory, streamed or from a prepared cache, over
the parallel dimensions it names. Each component gets its section of the job; nothing below
sees the command line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from hetero import parallel, ps
from hetero.cli.data import job_data
from hetero.cli.errors import report_error
from hetero.cli.plan import dense_optimizer, job_model, job_plan, plan_changes, planning_batches
from hetero.config.job import JobConfig, Resume, TableSharding
from hetero.config.manager import locate
from hetero.config.toml import job_to_dict, job_to_toml
from hetero.data import BatchConfig, Batches
from hetero.data.stream import StreamBatches
from hetero.embedding import dense_parameters, host_tables, set_num_threads
from hetero.models.wide_deep import mlp_sharding_plan, pipeline_split_points
from hetero.optim import FTRLConfig, SparseOptimizerKind
from hetero.optim.host_state import storage_bytes
from hetero.parallel import DataParallelConfig
from hetero.parallel.env import set_data_parallel_group
from hetero.parallel.parallelize import ParallelPlan, parallelize
from hetero.parallel.pipeline import pipeline
from hetero.parallel.pipeline_plan import PipelineConfig
from hetero.parallel.recompute import apply_recompute
from hetero.parallel.zero import ZeroConfig, local_elements, zero_optimizer
from hetero.placement import Target, resolve_device
from hetero.ps import PSConfig
from hetero.record import ModelRecord, RunRecord
from hetero.train import CheckpointFormat, TrainConfig, Trainer
from hetero.train.run_dir import check_run_dir, remove_run_files
from hetero.train.trainer import weighted_bce

log = logging.getLogger("hetero")


def _sparse_optimizer(kind: SparseOptimizerKind, tables, lr: float, job: JobConfig):  # noqa: ANN001, ANN202
    if kind is SparseOptimizerKind.FTRL:
        return kind.optimizer(tables, FTRLConfig(lr=lr, l1=job.optimizer.ftrl_l1, l2=job.optimizer.ftrl_l2))
    return kind.optimizer(tables, kind.optimizer.Config(lr=lr))


def _operator_parallel_mesh(job: JobConfig):  # noqa: ANN202 - a DeviceMesh or None
    """With ``--tp N`` > 1: the job's mesh, every rank operator-parallel (the data-parallel
    dimension is 1: each rank reads the whole batch, as ``DatasetStrategy.FULL_BATCH``)."""
    p = job.parallelism
    if p.tp == 1:
        return None
    if job.parameter_server.servers or p.table_sharding is TableSharding.ROW or job.training.prefetch:
        raise ValueError("--tp works with replicated host tables: drop --ps-servers, --table-sharding row and --prefetch")
    if parallel.world_size() != p.tp:
        raise ValueError(f"--tp {p.tp} runs every rank operator-parallel: start torchrun --nproc-per-node {p.tp} "
                         f"(this job has {parallel.world_size()} ranks); data x operator parallel (a 2-D mesh) is "
                         f"hetero.parallel's (apply_sharding with batch slices), not yet hetero train's")
    mesh = parallel.build_mesh(parallel.MeshConfig(tp=p.tp))
    # The data-parallel group is this rank alone: no DDP, no sparse-gradient exchange, every rank
    # the whole batch; the tables stay identical because every rank applies the same updates.
    set_data_parallel_group(mesh[parallel.MeshDim.DP.value].get_group())
    return mesh


def _pipeline_mesh(job: JobConfig):  # noqa: ANN202 - a DeviceMesh
    """With ``--pp N`` > 1: the job's mesh, one pipeline stage per rank (the data-parallel
    dimension is 1: every rank reads the whole batch, the first stage's rank its features)."""
    p = job.parallelism
    others = [flag for flag, on in (("--tp", p.tp > 1), ("--zero", p.zero), ("--ps-servers", job.parameter_server.servers),
                                    ("--table-sharding row", p.table_sharding is TableSharding.ROW), ("--prefetch", job.training.prefetch),
                                    ("--checkpoint-format sharded", job.checkpoint.format is CheckpointFormat.SHARDED)) if on]
    if others:
        raise ValueError(f"--pp runs the pipeline alone in hetero train (replicated tables, integrated checkpoints): "
                         f"drop {', '.join(others)}")
    if parallel.world_size() != p.pp:
        raise ValueError(f"--pp {p.pp} runs one stage per rank: start torchrun --nproc-per-node {p.pp} (this job "
                         f"has {parallel.world_size()} ranks); pipeline x data parallel is hetero.parallel's "
                         f"(pipeline over a pp x dp mesh), not yet hetero train's")
    micro = p.micro_batches or p.pp
    if job.training.batch_size % micro:
        raise ValueError(f"--micro-batches {micro} does not divide --batch-size {job.training.batch_size}: choose a batch size "
                         f"that is a multiple of the micro-batches")
    mesh = parallel.build_mesh(parallel.MeshConfig(pp=p.pp))
    set_data_parallel_group(mesh[parallel.MeshDim.DP.value].get_group())  # this rank alone: no DDP, no exchange
    return mesh


def build_trainer(job: JobConfig, on_step=None, mesh=None,  # noqa: ANN001 - a DeviceMesh
                  ) -> tuple[Trainer | None, Callable[[], None]]:
    """The trainer of this process (``None`` on a parameter server, which has served the job by
    the time this returns) and what writes the run's own files (``plan.json``,
    ``strategy.json``): called after a resume's checks, every rank (nothing is written before
    them). With ``mesh`` (``--tp``, ``--pp``), the model is split over it. Nothing is written
    into the run directory here."""
    torch.manual_seed(job.training.seed)
    job = locate(job)  # absolute data paths: the config.toml it writes reads the same files from anywhere
    p = job.parallelism
    data = job_data(job)
    # a parameter server runs no model: it keeps it on the host and leaves the accelerator alone
    device = torch.device("cpu") if ps.role() is ps.Role.SERVER else resolve_device(Target.DEVICE)
    model, model_config = job_model(job, data.specs, data.num_dense, device)
    plan = planned = strategy = None
    if job.planner.plan:
        if isinstance(data.train, StreamBatches) or p.pp > 1 or p.tp > 1 or job.parameter_server.servers:
            raise ValueError("--plan plans a data-parallel job on in-memory or prepared data: drop --stream (prepare a "
                             "cache: hetero data prepare), --pp, --tp and --ps-servers")
        plan = planned = job_plan(job, model, planning_batches(job, data.train))
        job = plan_changes(plan, job, model)  # the table placement and ZeRO stage it chose
        p = job.parallelism
        apply_recompute(model, plan.recompute_config())
    pipe = None
    if p.pp > 1:
        pp_config = PipelineConfig(p.schedule, p.micro_batches or p.pp,
                                   split_points=pipeline_split_points(model, p.pp))
        pipe = pipeline(model, pp_config, mesh, weighted_bce)
        model = pipe.modules[0]  # this rank's stage: the host tables live in stage 0 only
        log.info("%s", pipe.plan)
    if job.training.prefetch and (p.table_sharding is TableSharding.ROW or job.parameter_server.servers):
        raise ValueError("--prefetch works with replicated tables only; drop it or use --table-sharding replicated "
                         "without --ps-servers")
    if job.parameter_server.servers:
        ps.shard_tables(model)  # before the optimizers: their state is allocated per shard, on the servers
    elif p.table_sharding is TableSharding.ROW:
        parallel.shard_rows(model)
    tables = host_tables(model)
    parts = {"wide": (job.optimizer.wide, job.optimizer.wide_lr), "deep": (job.optimizer.deep, job.optimizer.deep_lr)}
    sparse = {part: _sparse_optimizer(kind, own, lr, job) for part, (kind, lr) in parts.items()
              if (own := {k: v for k, v in tables.items() if k.startswith(f"{part}.")})}  # (DLRM: no wide tables;
    # a later pipeline stage: none)
    if job.parameter_server.servers:
        ps.start(model, sparse)  # memory budgets checked on every rank; a server serves here until the workers stop
        if ps.role() is ps.Role.SERVER:
            return None, lambda: None
    zero = ZeroConfig(p.zero, units=("mlp",))
    if p.zero and job.parameter_server.servers:
        raise ValueError("--zero shards the dense part over the data-parallel ranks; a parameter-server job's "
                         "workers are not the whole mesh: drop --zero or --ps-servers")
    if p.zero and mesh is None:
        mesh = parallel.build_mesh(parallel.MeshConfig())  # every rank data-parallel
    if mesh is not None and pipe is None:  # operator sharding, then ZeRO (FSDP2 over dp; the host tables are left out)
        plan = ParallelPlan(sharding=mlp_sharding_plan(model, p.tp) if p.tp > 1 else None, zero=zero)
        layout = parallelize(model, plan, mesh)
        if layout:
            local = storage_bytes(model.mlp.parameters())  # DTensors count their local shards
            whole = sum(p.numel() * p.element_size() for p in model.mlp.parameters())
            log.info("hetero: deep MLP operator-parallel over %d ranks: %d parameters sharded, %d of %d bytes per rank",
                     p.tp, sum(any(pl.is_shard() for pl in v) for v in layout.values()), local, whole)
            strategy = (mesh, layout)  # written with the run's files, after a resume's checks
    # foreach=False under --tp: the parameters mix DTensor shards and plain tensors
    foreach = None if mesh is None or p.tp == 1 else False
    if plan is not None and mesh is None:  # where the plan puts the dense optimizer's state
        named = [(n, p) for n, p in model.named_parameters() if p in set(dense_parameters(model))]
        dense = dense_optimizer(plan, named, job.optimizer.dense_lr)
    else:
        dense = (zero_optimizer(dense_parameters(model), torch.optim.Adam, zero, mesh, lr=job.optimizer.dense_lr, foreach=foreach)
                 if mesh is not None and pipe is None else torch.optim.Adam(dense_parameters(model), lr=job.optimizer.dense_lr))
    if p.zero:
        log.info("hetero: ZeRO stage %d over %d data-parallel ranks: this rank updates %d of %d dense parameter "
                 "elements", p.zero, parallel.world_size(), local_elements(dense),
                 sum(p.numel() for p in dense_parameters(model)))
    n_rows = sum(t.config.num_embeddings for t in tables.values())
    where = f"on {job.parameter_server.servers} parameter servers" if job.parameter_server.servers else f"on this host ({p.table_sharding.value})"
    log.info("hetero: %s training samples; %d host tables, %d rows, %.1f MB %s; MLP on %s",
             "streamed" if isinstance(data.train, StreamBatches) else len(data.train), len(tables), n_rows,
             sum(t.weight.numel() * t.weight.element_size() for t in tables.values()) / 1e6, where, device)
    fmt = job.checkpoint.format or (CheckpointFormat.SHARDED if job.parameter_server.servers
                                    else CheckpointFormat.INTEGRATED)
    config = TrainConfig(epochs=job.training.epochs, checkpoint_every=job.checkpoint.every, max_steps=job.training.max_steps,
                         patience=job.training.patience, keep_best=job.checkpoint.keep_best,
                         progress=job.logging.progress, prefetch=job.training.prefetch, checkpoint_format=fmt,
                         data_parallel=DataParallelConfig(dense_sharded=p.zero >= 2),
                         tensorboard=job.logging.tensorboard)
    set_num_threads(job.training.threads)
    # what reads the run back (predict, a resume's checks), written inside every checkpoint
    record = RunRecord(ModelRecord(job.model.name.value, dataclasses.asdict(model_config), data.num_dense),
                       data.encoding, data.reader, job_to_dict(job), None if planned is None else planned.to_dict())
    batches = data.train if isinstance(data.train, StreamBatches) else Batches(
        data.train, BatchConfig(batch_size=job.training.batch_size, shuffle=True, seed=job.training.seed, rank=parallel.rank(),
                                world_size=parallel.world_size()))
    return Trainer(model, dense, sparse, batches, data.valid, data.test, config, job.checkpoint.run_dir, on_step=on_step,
                   pipeline=pipe, record=record.to_state(), run_files={"config.toml": job_to_toml(job)}
                   ), functools.partial(_write_run_files, job.checkpoint.run_dir, planned,
                                                                             strategy)


def _write_run_files(run_dir: Path, plan, strategy) -> None:  # noqa: ANN001 - a Plan, a (mesh, layout) pair
    """The run's own readable files (every rank calls it: the strategy's write is collective)."""
    if plan is not None and parallel.global_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        plan.save(run_dir / "plan.json")
    if strategy is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        parallel.save_strategy(run_dir / "strategy.json", *strategy)  # the resolved layout


def run_train(job: JobConfig, on_step=None) -> int:  # noqa: ANN001 - a callable of the Trainer
    """Run ``hetero train``: join the process group (torchrun's, or a single process), build the
    trainer, resume or start, train; print the metrics as one JSON line (rank 0); the exit status."""
    rank, failed, trainer, metrics = 0, True, None, {}
    servers = job.parameter_server.servers
    try:
        # A parameter-server job's default group is gloo: its servers use no accelerator (the
        # workers' group may be NCCL).
        parallel.init(parallel.DistConfig(backend="gloo") if servers else parallel.DistConfig())
        if servers:
            s = job.parameter_server
            ps.init(PSConfig(num_servers=servers, mode=s.mode, staleness=s.staleness,
                             server_memory_bytes=int(s.server_memory_mb * 2**20), timeout_s=s.timeout))
        c = job.checkpoint
        check_run_dir(c.run_dir, None if c.resume is None else c.resume.value, c.overwrite)
        mesh = _pipeline_mesh(job) if job.parallelism.pp > 1 else _operator_parallel_mesh(job)
        rank = parallel.global_rank()
        if rank != 0:  # one voice per job: the other ranks only warn
            logging.getLogger("hetero").setLevel(logging.WARNING)
        trainer, write_run_files = build_trainer(job, on_step, mesh)
        if trainer is None:  # a parameter server: the workers are done
            failed = False
            return 0
        if c.resume is Resume.YES or (c.resume is Resume.AUTO and trainer.has_checkpoint()):
            trainer.resume()  # checks the checkpoint against this run before it loads anything
        elif c.overwrite and rank == 0:
            remove_run_files(c.run_dir)  # every check has passed: the old run's files go (rank 0 writes them all)
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
