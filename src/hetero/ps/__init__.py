"""Parameter server: tables sharded over server processes, pulled and pushed by workers.

For tables beyond one host's memory. One torchrun job of ``S + W`` processes: the last ``S``
ranks are servers, each holding a hash shard of every table group with its sparse optimizer
state (:mod:`hetero.ps.server`); the first ``W`` ranks are workers that train data-parallel among
themselves (DDP over the workers' group) and pull and push table rows (:mod:`hetero.ps.client`).
Everything travels over torch.distributed (gloo point-to-point for requests, DCP for
checkpoints); see :mod:`hetero.ps.transport`. Every process runs the same script::

    role = ps.init(PSConfig(num_servers=2))     # after parallel.init(); tables built later are deferred
    model = build_model()                       # the same seed everywhere; no table rows allocated
    ps.shard_tables(model)                      # servers build their shard; workers get clients
    sparse = {"deep": LazyAdam(...), ...}       # on servers: state for the shard's rows
    ps.start(model, sparse)                     # memory budget check; servers serve until the workers stop
    if role is Role.WORKER:
        ... Trainer(model, ...).fit() ...       # wraps the sparse optimizers in PSSparse
    ps.shutdown()                               # workers: stop the servers

The reference is MindSpore's parameter server (worker pull/push, server-side optimizer,
synchronous); the modes (:class:`PSMode`) follow PaddlePaddle's and Persia's asynchronous
training and HET's bounded-staleness cache.

Security: the servers answer any process of the job, unauthenticated and unencrypted, as all of
torch.distributed does; the network between the hosts must be trusted. With ``--standalone`` or
a loopback ``MASTER_ADDR`` the store and gloo bind to loopback (:func:`hetero.parallel.init`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetero.embedding import RowPlacement, defer_tables, table_groups
from hetero.parallel.env import set_data_parallel_group
from hetero.ps.client import PSClient, PSSparse, RowCache, broadcast
from hetero.ps.config import PSConfig, PSMode, Role
from hetero.ps.server import ParameterServer, ServerShard, build_shard, shard_rows_count
from hetero.ps.transport import Channel, Op, ServerLostError, ServerTimeoutError

log = logging.getLogger("hetero")

__all__ = [
    "PSClient",
    "PSConfig",
    "PSMode",
    "PSSparse",
    "ParameterServer",
    "Role",
    "RowCache",
    "ServerLostError",
    "ServerTimeoutError",
    "init",
    "remote_tables",
    "request_checkpoint",
    "role",
    "shard_tables",
    "shutdown",
    "start",
]


@dataclasses.dataclass
class _Job:
    config: PSConfig
    role: Role
    servers: list[int]
    workers: list[int]
    pg: Any  # gloo group over every rank: the requests
    channel: Channel | None = None
    server: ParameterServer | None = None
    clients: list[PSClient] = dataclasses.field(default_factory=list)


_JOB: list[_Job] = []


def init(config: PSConfig) -> Role:
    """Split the job into servers (the last ``config.num_servers`` ranks) and workers; every rank
    calls it after :func:`hetero.parallel.init`. From here on, ``hetero.parallel.rank()`` /
    ``world_size()`` / DDP / the host collectives of a worker cover the workers only, and host
    tables built in this process hold no rows (:func:`hetero.embedding.defer_tables`).

    Raises:
        ValueError: no process group (not launched by torchrun), or no rank left for workers.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"a parameter server needs a multi-process job: launch with torchrun --nproc-per-node "
                         f"{config.num_servers}+W (servers + workers)")
    world, me = dist.get_world_size(), dist.get_rank()
    if config.num_servers >= world:
        raise ValueError(f"num_servers={config.num_servers} leaves no worker in a job of {world} processes; launch "
                         f"with torchrun --nproc-per-node {config.num_servers}+W, W >= 1")
    workers = list(range(world - config.num_servers))
    servers = list(range(world - config.num_servers, world))
    # new_group is collective over the whole job: every rank creates every group, in this order.
    # The workers' data-parallel group is NCCL when they have accelerators (dense gradients on the
    # device), with a gloo twin for host tensors; servers need no accelerator (launch the job's
    # default group on gloo: parallel.init(DistConfig(backend="gloo")), as `hetero train` does).
    cuda = torch.cuda.is_available()
    dp = dist.new_group(workers, backend="nccl" if cuda else "gloo")
    dp_host = dist.new_group(workers, backend="gloo") if cuda else None
    # A server waits for requests as long as the job lives: the group's own timeout is long, the
    # workers' deadline for an answer is PSConfig.timeout_s (transport.Channel).
    pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
    role = Role.SERVER if me in servers else Role.WORKER
    job = _Job(config, role, servers, workers, pg)
    if role is Role.WORKER:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", me)) % torch.cuda.device_count())
        set_data_parallel_group(dp, dp_host)
        job.channel = Channel(pg, config.timeout_s, {r: s for s, r in enumerate(servers)})
    _JOB[:] = [job]
    defer_tables(True)
    log.info("hetero: parameter-server job: %d servers (ranks %s), %d workers, %s mode", len(servers),
             servers, len(workers), config.mode.value)
    return role


def role() -> Role | None:
    """This process's role, or ``None`` outside a parameter-server job."""
    return _JOB[0].role if _JOB else None


def _job() -> _Job:
    if not _JOB:
        raise ValueError("hetero.ps.init(PSConfig(...)) was not called in this process")
    return _JOB[0]


def shard_tables(model: nn.Module) -> int:
    """Put every table group of ``model`` on the servers; returns how many groups.

    On a server, the group's storage becomes its shard (hash partition, rows built from the
    tables' seeds); on a worker, the group gets a :class:`PSClient` and holds no rows. Call it on
    every rank after building the model and before building the sparse optimizers.
    """
    job = _job()
    groups = table_groups(model)
    n = len(job.servers)
    for index, group in enumerate(groups.values()):
        if group.exchange.placement is not RowPlacement.LOCAL:
            continue
        if job.role is Role.SERVER:
            s = job.servers.index(dist.get_rank())
            global_rows = group.num_rows
            need = shard_rows_count(global_rows, s, n) * group.dim * group.storage.element_size()
            budget = job.config.server_memory_bytes
            if budget and need > budget:
                continue  # reported by start(), on every rank; nothing allocated
            group.storage = build_shard(group, s, n)
            group.exchange = ServerShard(global_rows, s, n)
        else:
            staleness = job.config.staleness if job.config.mode is PSMode.BOUNDED else None
            group.exchange = PSClient(group, index, job.servers, job.channel, staleness)
            job.clients.append(group.exchange)
    return len(groups)


def start(model: nn.Module, sparse_optimizers: dict[str, Any]) -> None:
    """Check every server's memory budget (on every rank: a shard over budget fails the whole job
    with the same message), then, on a server, serve until every worker called :func:`shutdown`.
    Every rank calls it after building the sparse optimizers.

    Raises:
        ValueError: a server's shard (rows + optimizer state) exceeds ``server_memory_bytes``,
            naming the server rank, both sizes and the fix.
    """
    job = _job()
    problem = None
    if job.role is Role.SERVER:
        groups = table_groups(model)
        s = job.servers.index(dist.get_rank())
        if any(g.exchange.placement is not RowPlacement.SERVER_SHARD for g in groups.values()):
            rows = [g.exchange.global_rows for g in groups.values()]
            need = sum(shard_rows_count(r, s, len(job.servers)) * g.dim * g.storage.element_size()
                       for r, g in zip(rows, groups.values()))
            problem = f"its table rows alone need {_mib(need)}"
        else:
            job.server = ParameterServer(groups, dict(sparse_optimizers), s, len(job.servers), job.workers, job.pg,
                                         job.config.mode, job.config.gradients_mean)
            need = job.server.nbytes()
            if job.config.server_memory_bytes and need > job.config.server_memory_bytes:
                problem = f"its shard needs {_mib(need)} (table rows and optimizer state)"
        if problem:
            problem = (f"parameter server rank {dist.get_rank()} (shard {s} of {len(job.servers)}): {problem}, over its "
                       f"memory budget of {_mib(job.config.server_memory_bytes)} (server_memory_bytes); run "
                       f"more servers or raise the budget")
        else:
            log.warning("hetero: parameter server rank %d holds %s (shard %d of %d)", dist.get_rank(), _mib(need), s,
                        len(job.servers))
    reports: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, problem, group=job.pg)
    problems = [p for p in reports if p]
    if problems:
        raise ValueError(problems[0])
    if job.role is Role.SERVER:
        job.server.serve(_server_checkpoint)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


def _server_checkpoint(op: Op, path: str) -> None:
    from hetero.checkpoint.sharded import load_sharded, save_sharded

    server = _job().server
    state = server.state()
    if op is Op.SAVE:
        server.save_blob(state)
        save_sharded(state, path)
    else:
        load_sharded(state, path)
        server.load_blob(state)


def remote_tables(model: nn.Module) -> bool:
    """Whether ``model``'s tables live on parameter servers (this process is a worker)."""
    return any(g.exchange.placement is RowPlacement.PARAMETER_SERVER for g in table_groups(model).values())


def request_checkpoint(save: bool, path: str) -> None:
    """Worker side: ask every server to join the DCP save (``save``) or load of ``path``; every
    worker calls it right before its own ``save_sharded`` / ``load_sharded``."""
    job = _job()
    broadcast(job.channel, job.servers, Op.SAVE if save else Op.LOAD, str(path))
    if not save:
        for client in job.clients:
            client.reset()  # the servers count steps from the load too


def shutdown(clean: bool = True) -> None:
    """Leave the parameter-server job. On a worker with ``clean``: tell every server this worker is
    done (servers leave :func:`start` once all workers did). After an error (``clean=False``)
    nothing is sent: the servers see the connection close, and torchrun restarts the job."""
    if not _JOB:
        return
    job = _JOB[0]
    _JOB.clear()
    defer_tables(False)
    if clean and job.role is Role.WORKER and dist.is_initialized():
        for server in job.servers:
            for w in job.channel.request(server, Op.STOP, []):
                job.channel.wait(w, server, "the stop request")
