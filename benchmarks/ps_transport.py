"""What a parameter server's messages can move between two processes of this host (issue #39,
target 3): torch.distributed point-to-point on each backend this torch build has for CPU tensors
(``send``/``recv`` of one message there and one back, the PS's request and reply), against a
copy of the same bytes within one process (``Tensor.copy_``: what an in-process table pays to
hand rows over). The PS moves, per unique row of a step, its id and its row there and its
gradient back; this bounds its rows/s at one server from the transport alone.

    python benchmarks/ps_transport.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

SIZES = [1 << 16, 1 << 20, 1 << 22, 1 << 24]  # bytes a message
REPEATS = 20


def _rank(rank: int, backend: str, init: str, out: str) -> None:
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=2)
    result = {}
    for size in SIZES:
        buf = torch.empty(size, dtype=torch.uint8)
        times = []
        for i in range(REPEATS + 2):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:  # a request there, a reply back: 2 x size bytes moved
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        result[size] = 2 * size / statistics.median(times)
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


def point_to_point(backend: str) -> dict[int, float]:
    """Bytes/s of a round trip of each message size between two processes on ``backend``."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.pt")
        mp.start_processes(_rank, args=(backend, f"file://{d}/rendezvous", out), nprocs=2, start_method="spawn")
        return torch.load(out)


def in_process() -> dict[int, float]:
    """Bytes/s of copying each message size from one tensor into another in this process."""
    result = {}
    for size in SIZES:
        a, b = torch.ones(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            b.copy_(a)
            times.append(time.perf_counter() - t0)
        result[size] = size / statistics.median(times)
    return result


def main() -> None:
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("mpi", dist.is_mpi_available()),
                                ("ucc", dist.is_ucc_available())) if ok]
    result = {"message_bytes": SIZES, "backends_with_cpu_tensors": backends,
              "copy_bytes_per_s": {str(k): v for k, v in in_process().items()}}
    for backend in backends:
        result[f"{backend}_bytes_per_s"] = {str(k): v for k, v in point_to_point(backend).items()}
    top = str(SIZES[-2])  # 4 MiB: about a step's rows of benchmarks/ps.py (100k unique rows x 16 fp32 = 6.4 MB)
    result["gloo_over_copy_4mib"] = result["gloo_bytes_per_s"][top] / result["copy_bytes_per_s"][top]
    emit("ps_transport", result)


if __name__ == "__main__":
    main()
