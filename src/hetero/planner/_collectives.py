"""The collective measurement's ranks (a module of its own: spawned processes import it)."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_rank(rank: int, world: int, port: int, backend: str, queue: Any) -> None:  # noqa: ANN401 - a queue
    """One rank: time each collective at sizes 4 KiB..16 MiB per rank; rank 0 puts the points
    (bytes, seconds) in ``queue``."""
    from hetero.planner.calibration import timed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        points: dict[str, list[tuple[int, float]]] = {"all_reduce": [], "all_gather": [], "reduce_scatter": []}
        cpu = torch.device("cpu")
        for n in (1 << 10, 1 << 14, 1 << 18, 1 << 22):
            x = torch.rand(n)
            gathered = torch.empty(n * world)
            part = torch.empty(n // world)
            for name, fn in (("all_reduce", lambda: dist.all_reduce(x)),
                             ("all_gather", lambda: dist.all_gather_into_tensor(gathered, x)),
                             ("reduce_scatter", lambda: dist.reduce_scatter_tensor(part, x))):
                dist.barrier()
                points[name].append((4 * n, timed(fn, cpu, budget_s=0.03, max_repeats=10)))
        # each rank timed alone: take the slowest rank's time at each size (the collective ends there)
        gathered_points: list[Any] = [None] * world
        dist.all_gather_object(gathered_points, points)
        if rank == 0:
            queue.put({name: [(b, max(p[name][i][1] for p in gathered_points)) for i, (b, _) in enumerate(pts)]
                       for name, pts in points.items()})
    finally:
        dist.destroy_process_group()
