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
from hetero.cli.data import job_data, with_prepared
from hetero.cli.errors import report_error
from hetero.cli.plan import dense_optimizer, job_model, job_plan, plan_changes, planning_batches, ssd_settings
from hetero.config.job import JobConfig, Resume, TableSharding, TableStorage
from hetero.config.manager import locate
from hetero.config.toml import job_to_dict, job_to_toml
from hetero.data import BatchConfig, Batches
from hetero.data.stream import StreamBatches
from hetero.embedding import dense_parameters, host_tables, move_tables_to_ssd, set_num_threads
from hetero.models.wide_deep import mlp_sharding_plan, pipeline_split_points
from hetero.optim import FTRLConfig, SparseOptimizerKind
from hetero.optim.host_state import storage_bytes
from hetero.parallel import DataParallelConfig
from hetero.parallel.dims import ParallelDims
from hetero.parallel.parallelize import ParallelPlan, parallelize
from hetero.parallel.pipeline_plan import PipelineConfig
from hetero.parallel.recompute import RecomputeConfig
from hetero.parallel.zero import ZeroConfig, local_elements
from hetero.placement import Target, resolve_device
from hetero.placement.threads import available_cores, default_compute_threads
from hetero.ps import PSConfig
from hetero.record import ModelRecord, RunRecord
from hetero.train import CheckpointFormat, TrainConfig, Trainer
from hetero.train.run_dir import RunLock, check_run_dir, record_run_files, remove_run_files
from hetero.train.trainer import weighted_bce

log = logging.getLogger("hetero")


def _sparse_optimizer(kind: SparseOptimizerKind, lr: float, job: JobConfig) -> Callable[[dict], object]:
    """A factory of ``kind`` over the tables it is given, at ``lr`` (FTRL: the job's l1, l2)."""
    if kind is SparseOptimizerKind.FTRL:
        config = FTRLConfig(lr=lr, l1=job.optimizer.ftrl_l1, l2=job.optimizer.ftrl_l2)
    else:
        config = kind.optimizer.Config(lr=lr)
    return lambda tables: kind.optimizer(tables, config)


def job_dims(job: JobConfig) -> ParallelDims:
    """The job's parallel dimensions over this process group, validated: the main job runs
    ``tp`` or ``pp`` with every rank in it (each rank reads the whole batch: ``dp`` 1), or
    ``dp`` over every rank (with ZeRO, row-sharded tables or parameter servers).

    Raises:
        ValueError: naming the keys and the torchrun command that fit.
    """
    p, servers = job.parallelism, job.parameter_server.servers
    world = parallel.world_size()
    for key, size in (("tp", p.tp), ("pp", p.pp)):
        if size > 1 and world != size:
            raise ValueError(f"parallelism.{key} = {size} (--{key}) runs every rank of hetero train in it: start "
                             f"torchrun --nproc-per-node {size} (this job has {world} ranks); {key} x dp is "
                             f"hetero.apply's (a plan over a pp x dp x tp mesh), not yet hetero train's")
    dims = ParallelDims.of_job(pp=p.pp, tp=p.tp, zero=p.zero, servers=servers,
                               row_sharded=p.table_sharding is TableSharding.ROW, world=world)
    return dims


def build_trainer(job: JobConfig, dims: ParallelDims | None = None, ps_job: ps.PSJob | None = None,
                  on_step=None) -> tuple[Trainer | None, Callable[[], None]]:  # noqa: ANN001 - on_step: a callable
    """The trainer of this process (``None`` on a parameter server, which has served the job by
    the time this returns) and what writes the run's own files (``plan.json``,
    ``strategy.json``): called after a resume's checks, every rank (nothing is written before
    them). ``dims``: the job's (default :func:`job_dims`), built here; ``ps_job``: with
    parameter servers. The model goes through the composition root,
    :func:`hetero.parallel.parallelize.parallelize`. Nothing is written into the run directory here."""
    torch.manual_seed(job.training.seed)
    job = locate(job)  # absolute data paths: the config.toml it writes reads the same files from anywhere
    job = with_prepared(job)  # a prepared cache's job checked against this one (the record says what it trains on)
    server = ps_job is not None and ps_job.role is ps.Role.SERVER
    dims = (dims or job_dims(job)).build(ps_job.dp if ps_job is not None and not server else None)
    data = job_data(job, dims.dp_group)
    # a parameter server runs no model: it keeps it on the host and leaves the accelerator alone
    device = torch.device("cpu") if server else resolve_device(Target.DEVICE)
    if job.tables.storage is TableStorage.AUTO and not job.planner.plan:
        raise ValueError("tables.storage = auto (--table-storage auto) lets the planner choose: add --plan auto (and "
                         "planner.host_memory, the budget the tables must fit), or choose memory or ssd")
    model, model_config = job_model(job, data.specs, data.num_dense, device)
    planned = strategy = None
    recompute = RecomputeConfig()
    if job.planner.plan:
        planned = job_plan(job, model, planning_batches(job, data.train))
        job = plan_changes(planned, job, model)  # the table placement and ZeRO stage it chose
        if planned.ssd_tables:  # the tables it puts on the SSD tier (this job's directory: the plan chose which)
            move_tables_to_ssd(model, list(planned.ssd_tables), ssd_settings(job))
        dims = job_dims(job).build()  # (a data-parallel job: its ZeRO stage's mesh over every rank)
        recompute = planned.recompute_config()
    p, o = job.parallelism, job.optimizer
    pp_config = PipelineConfig(p.schedule, p.micro_batches or p.pp, split_points=pipeline_split_points(model, p.pp)) \
        if p.pp > 1 else None
    dense, kwargs = torch.optim.Adam, {"lr": o.dense_lr}
    if planned is not None and dims.mesh is None:  # where the plan puts the dense optimizer's state
        dense, kwargs = functools.partial(dense_optimizer, planned, lr=o.dense_lr), {}
    plan = ParallelPlan(sharding=mlp_sharding_plan(model, p.tp) if p.tp > 1 else None, recompute=recompute,
                        zero=ZeroConfig(p.zero, units=("mlp",)), pipeline=pp_config, loss_fn=weighted_bce,
                        sparse={part: _sparse_optimizer(kind, lr, job) for part, kind, lr in
                                (("wide", o.wide, o.wide_lr), ("deep", o.deep, o.deep_lr))},
                        dense=dense, dense_kwargs=kwargs)
    made = parallelize(model, dims, plan, ps_job)  # (DLRM: no wide tables; a later pipeline stage: none)
    model = made.model
    if made.pipeline is not None:
        log.info("%s", made.pipeline.plan)
    if ps_job is not None:
        ps_job.start(model, made.sparse_optimizers)  # budgets checked on every rank; a server serves until the end
        if server:
            return None, lambda: None
    if made.layout:
        local = storage_bytes(model.mlp.parameters())  # DTensors count their local shards
        whole = sum(w.numel() * w.element_size() for w in model.mlp.parameters())
        log.info("hetero: deep MLP operator-parallel over %d ranks: %d parameters sharded, %d of %d bytes per rank",
                 p.tp, sum(any(pl.is_shard() for pl in v) for v in made.layout.values()), local, whole)
        strategy = (dims.mesh, made.layout)  # written with the run's files, after a resume's checks
    if p.zero:
        log.info("hetero: ZeRO stage %d over %d data-parallel ranks: this rank updates %d of %d dense parameter "
                 "elements", p.zero, dims.dp, local_elements(made.dense_optimizer),
                 sum(w.numel() for w in dense_parameters(model)))
    _log_tables(job, model, data, device)
    fmt = job.checkpoint.format or (CheckpointFormat.SHARDED if job.parameter_server.servers
                                    else CheckpointFormat.INTEGRATED)
    config = TrainConfig(epochs=job.training.epochs, checkpoint_every=job.checkpoint.every,
                         max_steps=job.training.max_steps, patience=job.training.patience,
                         eval_batch_size=job.training.eval_batch_size,
                         keep_best=job.checkpoint.keep_best, progress=job.logging.progress,
                         prefetch=job.training.prefetch, checkpoint_format=fmt,
                         data_parallel=DataParallelConfig(dense_sharded=p.zero >= 2),
                         tensorboard=job.logging.tensorboard)
    threads = job.training.threads or default_compute_threads()
    torch.set_num_threads(threads)  # torch's intra-op pool and the host kernels alike (OMP_NUM_THREADS's reach)
    set_num_threads(threads)
    log.info("hetero: %d compute thread%s (training.threads, --threads; %s)", threads, "" if threads == 1 else "s",
             "given" if job.training.threads else f"the default on this host's {available_cores()} cores")
    # what reads the run back (predict, a resume's checks), written inside every checkpoint
    record = RunRecord(ModelRecord(job.model.name.value, dataclasses.asdict(model_config), data.num_dense),
                       data.encoding, data.reader, job_to_dict(job), None if planned is None else planned.to_dict())
    batches = data.train if isinstance(data.train, StreamBatches) else Batches(data.train, BatchConfig(
        batch_size=job.training.batch_size, shuffle=True, seed=job.training.seed, rank=dims.dp_group.rank,
        world_size=dims.dp_group.size))
    trainer = Trainer(model, made.dense_optimizer, made.sparse_optimizers, batches, data.valid, data.test, config,
                      job.checkpoint.run_dir, on_step=on_step, pipeline=made.pipeline, record=record.to_state(),
                      run_files={"config.toml": job_to_toml(job)}, dp=dims.dp_group, ps_job=ps_job, bad_rows=data.bad)
    return trainer, functools.partial(_write_run_files, job.checkpoint.run_dir, planned, strategy)


def _log_tables(job: JobConfig, model: torch.nn.Module, data, device: torch.device) -> None:  # noqa: ANN001
    tables = host_tables(model)
    n_rows = sum(t.config.num_embeddings for t in tables.values())
    servers = job.parameter_server.servers
    where = f"on {servers} parameter servers" if servers else f"on this host ({job.parallelism.table_sharding.value})"
    on_ssd = [n for n, t in tables.items() if t.config.ssd is not None]
    if on_ssd:
        where = (f"{len(on_ssd)} of them " if len(on_ssd) < len(tables) else "") + f"on the SSD tier in {job.tables.ssd_path or job.checkpoint.run_dir / 'ssd'} ({job.tables.cache_mb} MiB " \
                f"row cache per table group)"
    log.info("hetero: %s training samples; %d host tables, %d rows, %.1f MB %s; MLP on %s",
             "streamed" if isinstance(data.train, StreamBatches) else len(data.train), len(tables), n_rows,
             sum(t.weight.numel() * t.weight.element_size() for t in tables.values()) / 1e6, where, device)


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
    rank, failed, trainer, metrics, ps_job = 0, True, None, {}, None
    servers = job.parameter_server.servers
    try:
        # A parameter-server job's default group is gloo: its servers use no accelerator (the
        # workers' group may be NCCL).
        parallel.init(parallel.DistConfig(backend="gloo") if servers else parallel.DistConfig())
        if servers:
            s = job.parameter_server
            ps_job = ps.PSJob.init(PSConfig(num_servers=servers, mode=s.mode, staleness=s.staleness,
                                            server_memory_bytes=int(s.server_memory_mb * 2**20), timeout_s=s.timeout))
        dims = job_dims(job)  # the ranks checked before the run directory is
        c = job.checkpoint
        check_run_dir(c.run_dir, None if c.resume is None else c.resume.value, c.overwrite)
        rank = parallel.global_rank()
        if rank != 0:  # one voice per job: the other ranks only warn
            logging.getLogger("hetero").setLevel(logging.WARNING)
        # this rank's SSD store, if it holds one (a parameter-server job's workers hold no rows: their servers do)
        holds = job.tables.storage is not TableStorage.MEMORY and (ps_job is None or ps_job.role is ps.Role.SERVER)
        store = ssd_settings(job).directory if holds else None
        with RunLock(c.run_dir, store, rank) as held:  # one run per run directory and SSD store, for its life
            trainer, write_run_files = build_trainer(job, dims, ps_job, on_step)
            if trainer is None:  # a parameter server: the workers are done
                failed = False
                return 0
            if c.resume is Resume.YES or (c.resume is Resume.AUTO and trainer.has_checkpoint()):
                trainer.resume()  # checks the checkpoint against this run before it loads anything
            elif c.overwrite and rank == 0:
                remove_run_files(c.run_dir)  # every check has passed: the old run's files go (rank 0 writes them all)
            held.started()
            if rank == 0:
                record_run_files(c.run_dir, store)
            write_run_files()
            metrics = trainer.fit()
        failed = False
    except Exception as e:  # noqa: BLE001 - reported, then the exit code says it failed
        report_error(e)
        return 1  # under torchrun --max-restarts, a failed rank makes the job restart from the checkpoint
    finally:
        trainer = None  # release the DDP wrapper before its process group goes (see parallel.shutdown)
        if ps_job is not None:
            ps_job.shutdown(clean=not failed)  # a parameter-server worker: tell the servers it is done
        parallel.shutdown(clean=not failed)
    if rank == 0:
        print(json.dumps({k: v for k, v in metrics.items() if k != "history"}, allow_nan=False))  # null, never NaN
    return 0
