"""The parameter-server job: one :class:`PSJob` per process, a small state machine -
:meth:`PSJob.init` (roles and groups), :meth:`~PSJob.shard_tables`, :meth:`~PSJob.start` (a
server serves there until the workers stop), :meth:`~PSJob.shutdown` - passed to what needs it
(the trainer), never held in module state. See :mod:`hetero.ps` for the design."""

from __future__ import annotations

import datetime
import enum
import functools
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetero.checkpoint.sharded import load_sharded, save_sharded
from hetero.embedding import RowPlacement, defer_tables, table_groups
from hetero.parallel.env import DataParallelGroup
from hetero.ps.client import PSClient, broadcast
from hetero.ps.config import PSConfig, PSMode, Role
from hetero.ps.server import ParameterServer
from hetero.ps.shard import ServerShard, build_shard, shard_rows, shard_rows_count
from hetero.ps.transport import Channel, Op

log = logging.getLogger("hetero")


class Stage(enum.Enum):
    """Where a :class:`PSJob` is: each method runs at its stage and moves it on."""

    JOINED = "joined"  # init: roles and groups made
    SHARDED = "sharded"  # shard_tables: the tables' rows on the servers
    STARTED = "started"  # start: budgets checked (a server has served by the time it returns)
    STOPPED = "stopped"  # shutdown


class PSJob:
    """This process's part of a parameter-server job (build it with :meth:`init`).

    Attributes:
        config: the job's :class:`PSConfig`.
        role: this process's :class:`Role`.
        servers, workers: the job's server and worker ranks.
        dp: the workers' data-parallel group (DDP, the loss average); ``None`` on a server.
        stage: the :class:`Stage` it is at.
    """

    def __init__(self, config: PSConfig, role: Role, servers: list[int], workers: list[int], pg: Any,  # noqa: ANN401
                 dp: DataParallelGroup | None) -> None:
        self.config, self.role, self.servers, self.workers = config, role, servers, workers
        self.pg, self.dp = pg, dp  # pg: a gloo group over every rank, for the requests
        self.channel: Channel | None = None
        self.server: ParameterServer | None = None
        self.clients: list[PSClient] = []
        self.stage = Stage.JOINED

    @classmethod
    def init(cls, config: PSConfig) -> "PSJob":
        """Split the job into servers (the last ``config.num_servers`` ranks) and workers; every
        rank calls it after :func:`hetero.parallel.init`. The workers train data-parallel among
        themselves on :attr:`dp`; host tables built in this process from here on hold no rows
        (:func:`hetero.embedding.defer_tables`) until :meth:`shutdown`.

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
        cuda = torch.cuda.device_count() > 0  # (not is_available(): it can say yes with the GPUs hidden from this process)
        dp = dist.new_group(workers, backend="nccl" if cuda else "gloo")
        dp_host = dist.new_group(workers, backend="gloo") if cuda else None
        # A server waits for requests as long as the job lives: the group's own timeout is long, the
        # workers' deadline for an answer is PSConfig.timeout_s (transport.Channel).
        pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
        role = Role.SERVER if me in servers else Role.WORKER
        job = cls(config, role, servers, workers, pg, DataParallelGroup(dp, dp_host) if role is Role.WORKER else None)
        if role is Role.WORKER:
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", me)) % torch.cuda.device_count())
            job.channel = Channel(pg, config.timeout_s, {r: s for s, r in enumerate(servers)})
        defer_tables(True)
        log.info("hetero: parameter-server job: %d servers (ranks %s), %d workers, %s mode", len(servers),
                 servers, len(workers), config.mode.value)
        return job

    def _at(self, stage: Stage, what: str) -> None:
        if self.stage is not stage:
            raise ValueError(f"PSJob.{what} runs after {_BEFORE[stage]}; this job is at {self.stage.value}")

    def shard_tables(self, model: nn.Module) -> int:
        """Put every table group of ``model`` on the servers; returns how many groups.

        On a server, the group's storage becomes its shard (hash partition, rows built from the
        tables' seeds; a group on the SSD tier: the shard on the tier, under its row cache, whose
        budget is what the server's memory budget counts); on a worker, the group gets a
        :class:`PSClient` and holds no rows. Every rank calls it after building the model and
        before building the sparse optimizers.

        Raises:
            ValueError: called out of order (see :class:`Stage`).
        """
        self._at(Stage.JOINED, "shard_tables")
        groups = table_groups(model)
        n = len(self.servers)
        for index, group in enumerate(groups.values()):
            if group.exchange.placement is not RowPlacement.LOCAL:
                continue
            if group.dynamic.tables and self.config.mode is not PSMode.SYNC:
                # (a row evicted between a worker's pull and its push would take another key's gradient)
                raise ValueError(f"dynamic tables {group.dynamic.tables} train on parameter servers in sync mode only: "
                                 f"a key's row may be given to another key between a worker's pull and its push in "
                                 f"{self.config.mode.value} mode; use --ps-mode sync (PSConfig.mode=PSMode.SYNC)")
            if self.role is Role.SERVER:
                s = self.servers.index(dist.get_rank())
                global_rows = group.num_rows
                rows = shard_rows_count(global_rows, s, n)
                if group.ssd_config is not None:  # the shard on the SSD tier: laid out from the seeds when first needed
                    group.place(ServerShard(global_rows, s, n), initial_rows=functools.partial(shard_rows, group, s, n),
                                storage=torch.empty((rows, group.dim), dtype=group.dtype, device="meta"), views=False)
                else:
                    budget = self.config.server_memory_bytes
                    if budget and rows * group.dim * group.storage.element_size() > budget:
                        continue  # reported by start(), on every rank; nothing allocated
                    group.place(ServerShard(global_rows, s, n), storage=build_shard(group, s, n), views=False)
            else:
                staleness = self.config.staleness if self.config.mode is PSMode.BOUNDED else None
                group.place(PSClient(group, index, self.servers, self.channel, staleness))
                self.clients.append(group.exchange)
        self.stage = Stage.SHARDED
        return len(groups)

    def start(self, model: nn.Module, sparse_optimizers: dict[str, Any]) -> None:
        """Check every server's memory budget (on every rank: a shard over budget fails the whole
        job with the same message), then, on a server, serve until every worker called
        :meth:`shutdown`. Every rank calls it after building the sparse optimizers.

        Raises:
            ValueError: a server's shard (rows + optimizer state) exceeds ``server_memory_bytes``,
                naming the server rank, both sizes and the fix; or called out of order.
        """
        self._at(Stage.SHARDED, "start")
        problem = None
        if self.role is Role.SERVER:
            groups = table_groups(model)
            s = self.servers.index(dist.get_rank())
            if any(g.exchange.placement is not RowPlacement.SERVER_SHARD for g in groups.values()):
                need = sum(g.ssd_config.cache_bytes if g.ssd_config is not None else
                           shard_rows_count(g.exchange.global_rows, s, len(self.servers)) * g.dim * g.storage.element_size()
                           for g in groups.values())
                problem = f"its table rows alone need {_mib(need)}"
            else:
                self.server = ParameterServer(groups, dict(sparse_optimizers), s, len(self.servers), self.workers,
                                              self.pg, self.config.mode, self.config.gradients_mean)
                need = self.server.nbytes()
                if self.config.server_memory_bytes and need > self.config.server_memory_bytes:
                    problem = f"its shard needs {_mib(need)} (table rows and optimizer state)"
            if problem:
                problem = (f"parameter server rank {dist.get_rank()} (shard {s} of {len(self.servers)}): {problem}, "
                           f"over its memory budget of {_mib(self.config.server_memory_bytes)} (server_memory_bytes); "
                           f"run more servers or raise the budget")
            else:
                log.warning("hetero: parameter server rank %d holds %s (shard %d of %d)", dist.get_rank(), _mib(need),
                            s, len(self.servers))
        reports: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, problem, group=self.pg)
        problems = [p for p in reports if p]
        if problems:
            raise ValueError(problems[0])
        self.stage = Stage.STARTED
        if self.role is Role.SERVER:
            self.server.serve(self._server_checkpoint)

    def _server_checkpoint(self, op: Op, path: str) -> None:
        # a save reads the key maps in place (the server answers nothing while it saves); a load
        # needs copies to write into, which the maps then validate and take
        state = self.server.state(live=op is Op.SAVE)
        if op is Op.SAVE:
            self.server.save_blob(state)
            save_sharded(state, path, self.server)  # (with the shard's SSD tier snapshots)
        else:
            load_sharded(state, path, self.server)
            self.server.load_blob(state)

    def request_checkpoint(self, save: bool, path: str) -> None:
        """Worker side: ask every server to join the DCP save (``save``) or load of ``path``;
        every worker calls it right before its own ``save_sharded`` / ``load_sharded``."""
        for client in self.clients:
            client.flush()  # the last step's push, still pending: the checkpoint holds its update
        broadcast(self.channel, self.servers, Op.SAVE if save else Op.LOAD, str(path))
        if not save:
            for client in self.clients:
                client.reset()  # the servers count steps from the load too

    def shutdown(self, clean: bool = True) -> None:
        """Leave the job; safe to call more than once. On a worker with ``clean``: tell every
        server this worker is done (servers leave :meth:`start` once all workers did). After an
        error (``clean=False``) nothing is sent: the servers see the connection close, and
        torchrun restarts the job."""
        if self.stage is Stage.STOPPED:
            return
        self.stage = Stage.STOPPED
        defer_tables(False)
        if clean and self.role is Role.WORKER and dist.is_initialized():
            for client in self.clients:
                client.flush()  # (the last step's push, when no checkpoint or epoch end sent it)
            for server in self.servers:
                for w in self.channel.request(server, Op.STOP, []):
                    self.channel.wait(w, server, "the stop request")


_BEFORE = {Stage.JOINED: "PSJob.init", Stage.SHARDED: "shard_tables", Stage.STARTED: "start",
           Stage.STOPPED: "shutdown"}


def remote_tables(model: nn.Module) -> bool:
    """Whether ``model``'s tables live on parameter servers (this process is a worker)."""
    return any(g.exchange.placement is RowPlacement.PARAMETER_SERVER for g in table_groups(model).values())


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3g} MiB"
