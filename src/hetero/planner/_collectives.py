"""The collective measurement's ranks, launched by torchrun (a fresh interpreter: nothing of the
caller's script is imported again): ``python -m torch.distributed.run --standalone
--nproc-per-node N -m hetero.planner._collectives OUT.json [BACKEND]``."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def measure() -> dict[str, list[tuple[int, float]]]:
    """Each collective's seconds at sizes 4 KiB..16 MiB per rank, the slowest rank's (the
    collective ends there): the lower quartile of a fixed number of calls - the same on every
    rank (a count each rank chose from its own timings would leave one rank in a collective
    the others never enter)."""
    import statistics
    import time

    world = dist.get_world_size()
    points: dict[str, list[tuple[int, float]]] = {"all_reduce": [], "all_gather": [], "reduce_scatter": []}
    for n in (1 << 10, 1 << 14, 1 << 18, 1 << 22):
        x, gathered, part = torch.rand(n), torch.empty(n * world), torch.empty(n // world)
        for name, fn in (("all_reduce", lambda: dist.all_reduce(x)),
                         ("all_gather", lambda: dist.all_gather_into_tensor(gathered, x)),
                         ("reduce_scatter", lambda: dist.reduce_scatter_tensor(part, x))):
            dist.barrier()
            fn()  # warm-up
            times = []
            for _ in range(8 if n < 1 << 22 else 4):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            points[name].append((4 * n, statistics.quantiles(times, n=4)[0]))
    every: list = [None] * world
    dist.all_gather_object(every, points)
    return {name: [(b, max(p[name][i][1] for p in every)) for i, (b, _) in enumerate(pts)]
            for name, pts in points.items()}


def main() -> None:
    out, backend = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "gloo"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of one host talk over loopback
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group(backend)
    try:
        result = measure()
        if dist.get_rank() == 0:
            tmp = f"{out}.tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
