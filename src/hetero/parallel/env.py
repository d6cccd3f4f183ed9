"""The process group: initialised from torchrun's environment; world size 1 needs nothing.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
:func:`init` joins the group (NCCL when CUDA is present, gloo otherwise). Without those variables
the job is a single process: every helper answers rank 0 of 1 and collectives are skipped, so
single-process code and distributed code are the same code.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import os
import socket

from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("hetero")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class DistConfig:
    backend: str | None = None  # None: nccl with CUDA, gloo otherwise
    timeout_s: float = 600.0


def init(config: DistConfig = DistConfig()) -> bool:
    """Join the process group described by torchrun's environment; returns whether one exists.

    Raises:
        ValueError: some torchrun variables are set and others are missing (naming them and the
            fix), or they are not integers where integers are needed.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    present = [v for v in TORCHRUN_VARS if v in os.environ]
    if not present:
        return False
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise ValueError(f"distributed environment incomplete: {', '.join(missing)} not set (found "
                         f"{', '.join(present)}); launch with `torchrun --nproc-per-node N ...` or set all of "
                         f"{', '.join(TORCHRUN_VARS)}")
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        if not os.environ[v].isdigit():
            raise ValueError(f"environment variable {v}={os.environ[v]!r} is not a non-negative integer")
    if int(os.environ["WORLD_SIZE"]) == 1:
        return False
    _bind_loopback()
    backend = config.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        local, gpus = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        if local >= gpus:  # NCCL needs a GPU of its own per rank
            raise ValueError(f"LOCAL_RANK={local} has no CUDA device: this node has {gpus} "
                             f"(torch.cuda.device_count()); start at most {gpus} process(es) per node with "
                             f"`torchrun --nproc-per-node {gpus}`, or train on the CPU with gloo by hiding the GPUs "
                             f"(CUDA_VISIBLE_DEVICES=)")
        torch.cuda.set_device(local)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.timeout_s))
    log.info("hetero: rank %d of %d (%s)", rank(), world_size(), backend)
    return True


LOOPBACK = ("localhost", "127.0.0.1", "::1")


def _bind_loopback() -> None:
    """A single-host job (``MASTER_ADDR`` loopback, as ``torchrun --standalone`` sets it) keeps gloo's
    sockets on the loopback interface too; by default gloo binds to the address the host name
    resolves to, reachable from the network. ``GLOO_SOCKET_IFNAME`` set by the user wins."""
    if "GLOO_SOCKET_IFNAME" in os.environ or os.environ.get("MASTER_ADDR") not in LOOPBACK:
        return
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # no interface list on this platform: leave gloo's default
        return
    lo = next((n for n in names if n in ("lo", "lo0")), None)
    if lo is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = lo


def active() -> bool:
    """Whether a process group with more than one rank exists (the whole job)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank in the whole job (0 without a process group); a data-parallel
    group's own rank is :attr:`DataParallelGroup.rank`."""
    return dist.get_rank() if active() else 0


def global_rank() -> int:
    """This process's rank in the whole job (0 without a process group): the one that writes
    the job's files is global rank 0 (the first worker of a parameter-server job, the first
    operator-parallel rank of the first data-parallel replica)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The whole job's ranks (1 without a process group)."""
    return dist.get_world_size() if active() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0)) if active() else 0


_HOST_GROUP: list = []


def host_group():  # noqa: ANN201 - a ProcessGroup or None
    """The process group for collectives on host tensors (sparse gradients, table rows): the
    default group when it is gloo, else (NCCL on CUDA) a gloo group over the same ranks, created
    on first use. Collective on first call: every rank must call it."""
    if not active() or dist.get_backend() == "gloo":
        return None
    if not _HOST_GROUP:
        _HOST_GROUP.append(dist.new_group(backend="gloo"))
    return _HOST_GROUP[0]


def global_mean(value: torch.Tensor) -> float:
    """The mean of a scalar over the whole job's ranks (e.g. the global batch's loss from
    equal-size shards), as a Python float on every rank; the value itself at world size 1.
    Collective; a sync point (the host reads the result). A data-parallel group's own:
    :meth:`DataParallelGroup.mean`."""
    return DataParallelGroup().mean(value)


def global_batch_mean(local_sum: torch.Tensor, global_batch_size: int) -> torch.Tensor:
    """This rank's share of the global batch's mean loss, for data parallel with averaged gradients.

    Args:
        local_sum: the loss summed over this rank's samples (any device; a scalar).
        global_batch_size: the number of samples of the global batch over all ranks (the last
            batch of an epoch may be short, and ranks may hold unequal or empty shares of it).

    Returns ``local_sum * world_size / global_batch_size``: DDP's (and the sparse exchange's)
    average over the ranks of these values is ``sum of all losses / global_batch_size``, the
    mean one process computes on the whole batch, however unequal the shares; an empty share
    contributes 0, not NaN. At world size 1 it is the plain mean. Over the whole job; a
    data-parallel group's own: :meth:`DataParallelGroup.batch_mean`.

    Raises:
        ValueError: ``global_batch_size`` is not positive.
    """
    return DataParallelGroup().batch_mean(local_sum, global_batch_size)


def barrier() -> None:
    if active():
        dist.barrier()


def shutdown(clean: bool = True) -> None:
    """Leave the process group (if any); safe to call more than once.

    ``clean=False`` (after an error, e.g. a peer died) skips the final barrier, which would fail.
    """
    if dist.is_available() and dist.is_initialized():
        # Objects that hold the group (a DDP wrapper and its reducer) may be unreachable but not
        # yet collected (reference cycles); collected after the group is destroyed - or at
        # interpreter exit - their C++ side aborts the process ("terminate called without an
        # active exception"). Collect them while the group still exists.
        gc.collect()
        if clean:
            dist.barrier()
        _HOST_GROUP.clear()
        dist.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class DataParallelGroup:
    """The ranks that train data-parallel: DDP's process group, the host tables' sparse-gradient
    exchange's and the loss average's - the whole job by default; a subgroup in a
    parameter-server job (its workers) or a mesh's ``dp`` dimension (one rank under ``--tp`` or
    ``--pp``). A value handed to what needs it (:class:`~hetero.parallel.dims.ParallelDims`
    builds it), never process-global state.

    Attributes:
        group: the process group (``None``: the default group, the whole job).
        host: a gloo group over the same ranks for host tensors where ``group`` is NCCL
            (``None``: ``group`` itself, or for the whole job :func:`host_group`).
    """

    group: Any = None  # a ProcessGroup
    host: Any = None  # a ProcessGroup

    @property
    def active(self) -> bool:
        """Whether the group has more than one rank (collectives run)."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.active else 0

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if self.active else 1

    def host_group(self):  # noqa: ANN201 - a ProcessGroup or None
        """The group for collectives on host tensors (gloo). Collective on first call for the
        whole job (see :func:`host_group`)."""
        if self.group is None:
            return host_group()
        return self.host if self.host is not None else self.group

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.group)

    def mean(self, value: torch.Tensor) -> float:
        """The mean of a scalar over this group's ranks, as a Python float on every rank (see
        :func:`global_mean`). Collective; a sync point."""
        if self.active:
            value = value.detach().clone()
            dist.all_reduce(value, group=self.group)  # on the value's device: NCCL for device tensors
            value /= self.size
        return value.item()

    def batch_mean(self, local_sum: torch.Tensor, global_batch_size: int) -> torch.Tensor:
        """This rank's share of the global batch's mean loss over this group (see
        :func:`global_batch_mean`, which says why the shares average to one process's mean).

        Raises:
            ValueError: ``global_batch_size`` is not positive.
        """
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        return local_sum * (self.size / global_batch_size)
