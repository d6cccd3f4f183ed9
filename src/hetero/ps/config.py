"""Typed configuration of a parameter-server job: :class:`PSConfig`, :class:`PSMode`, :class:`Role`."""

from __future__ import annotations

import dataclasses
import enum


class Role(enum.Enum):
    """What a process of a parameter-server job does: the last ``num_servers`` ranks serve tables,
    the others train (rank 0, which hosts torchrun's store and writes the metrics, is a worker)."""

    SERVER = "server"
    WORKER = "worker"


class PSMode(enum.Enum):
    """How servers order pulls and pushes.

    * ``SYNC``: a server applies step ``t`` once every worker pushed it (summed in worker rank
      order) and answers pulls for step ``t + 1`` only after that: the same updates as one process
      training on the global batch (MindSpore's synchronous PS).
    * ``ASYNC``: every push is applied on arrival as one optimizer step, pulls are answered at
      once (Downpour SGD, Dean et al., NeurIPS 2012; Persia's asynchronous embeddings).
    * ``BOUNDED``: ``ASYNC`` servers, and each worker caches pulled rows for at most ``staleness``
      of its own steps (HET, Miao et al., VLDB 2022: a cache with bounded staleness).
    """

    SYNC = "sync"
    ASYNC = "async"
    BOUNDED = "bounded"


@dataclasses.dataclass(frozen=True)
class PSConfig:
    """Attributes:
        num_servers: server processes (the last ranks of the job); the others are workers.
        mode: see :class:`PSMode`.
        staleness: ``BOUNDED`` only: a cached row is used for at most this many worker steps
            after its pull (0: never reused across steps).
        server_memory_bytes: each server's budget for its shard of the tables and their optimizer
            state, in bytes; 0: no limit. A shard over budget fails the job at start, on every rank.
        timeout_s: seconds a worker waits for a server's answer before raising
            :class:`~hetero.ps.ServerTimeoutError` naming the server's rank.
        gradients_mean: divide gradients by the number of workers ``W``, as data-parallel training
            does: a ``SYNC`` step then equals one process on the global batch, and an ``ASYNC`` push
            (a worker's ``1/W`` of a global batch) moves the rows by ``1/W`` of such a step.
    """

    num_servers: int = 1
    mode: PSMode = PSMode.SYNC
    staleness: int = 0
    server_memory_bytes: int = 0
    timeout_s: float = 60.0
    gradients_mean: bool = True

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError(f"PSConfig.num_servers must be >= 1, got {self.num_servers}")
        if self.staleness < 0:
            raise ValueError(f"PSConfig.staleness must be >= 0, got {self.staleness}")
        if self.staleness and self.mode is not PSMode.BOUNDED:
            raise ValueError(f"PSConfig.staleness={self.staleness} needs mode=PSMode.BOUNDED (got {self.mode.value})")
        if self.timeout_s <= 0:
            raise ValueError(f"PSConfig.timeout_s must be positive, got {self.timeout_s}")
