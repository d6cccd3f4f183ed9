"""``hetero.distributed``: the process group helpers of :mod:`hetero.parallel` under this name."""

from hetero.parallel.env import DistConfig, active, barrier, init, local_rank, rank, shutdown, world_size

__all__ = ["DistConfig", "active", "barrier", "init", "local_rank", "rank", "shutdown", "world_size"]
