"""Distributed training on torch.distributed: the process group, data parallelism.

``hetero.distributed`` is the same module under the name the docs use.
"""

from hetero.parallel.data_parallel import DataParallelConfig, ReplicatedSparse, check_replicas, data_parallel
from hetero.parallel.env import DistConfig, active, barrier, init, local_rank, rank, shutdown, world_size

__all__ = [
    "DataParallelConfig",
    "DistConfig",
    "ReplicatedSparse",
    "active",
    "barrier",
    "check_replicas",
    "data_parallel",
    "init",
    "local_rank",
    "rank",
    "shutdown",
    "world_size",
]
