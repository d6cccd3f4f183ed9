"""Parameter server: pull + push rows/s with 1, 2 and 4 server processes vs the in-process table.

One 1M x 16 fp32 table with LazyAdam, batches of 4096 x 26 uniform ids (about 100k unique rows
per step). One worker process; a step is: dedup the ids, pull the unique rows from their servers,
push one gradient row per unique row (the servers apply LazyAdam with the fused kernel; the push
travels with the next step's pull, one message to each server, as in training). ``ps_rows_per_s[S]`` is unique rows per second through that round trip with
``S`` servers (each row pulled and pushed once); ``local_rows_per_s`` is the same work in one
process - gather the rows, apply LazyAdam - with no transport, using all cores, and
``local_one_thread_rows_per_s`` with one thread, as a server process runs (issue #39's measure). The job's
processes run one thread each (as under torchrun) and share this machine's cores: on the 2-core
CI machine 2 and 4 servers + 1 worker oversubscribe it, so more servers add no throughput here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu, emit  # noqa: E402

from hetero import ps  # noqa: E402
from hetero.embedding import HostEmbedding, RowSpace, SparseGrad, TableConfig  # noqa: E402
from hetero.optim import LazyAdam  # noqa: E402
from hetero.parallel.env import shutdown  # noqa: E402
from hetero.placement.memory import retain_freed_memory  # noqa: E402
from hetero.ps.client import LookupGrad  # noqa: E402

B, F, D, ROWS = 4096, 26, 16, 1_000_000


def batches(count: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(0)
    return [torch.unique(torch.from_numpy(rng.integers(0, ROWS, B * F))) for _ in range(count)]


def median_rate(step, work: list[torch.Tensor], warmup: int) -> float:
    for ids in work[:warmup]:
        step(ids)
    rates = []
    for ids in work[warmup:]:
        t0 = time.perf_counter()
        step(ids)
        rates.append(ids.numel() / (time.perf_counter() - t0))
    return float(np.median(rates))


def local_rate(steps: int, warmup: int, threads: int | None = None) -> float:
    """The same rows gathered and updated in this process; ``threads``: the kernels' and torch's
    thread count (``None``: all cores)."""
    from hetero.embedding import set_num_threads

    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
        set_num_threads(threads)
    try:
        return _local_rate(steps, warmup)
    finally:
        torch.set_num_threads(saved)
        set_num_threads(None)


def _local_rate(steps: int, warmup: int) -> float:
    torch.manual_seed(0)
    table = HostEmbedding(TableConfig("t", ROWS, D))
    opt = LazyAdam([table])
    grad = torch.randn(B * F, D)

    def step(ids):
        table.group.storage.index_select(0, ids)  # what a pull reads
        table.group.pending.set(SparseGrad(ids, grad[: ids.numel()], RowSpace.GROUP))
        opt.step()

    return median_rate(step, batches(steps + warmup), warmup)


def _rank(rank: int, world: int, port: int, steps: int, warmup: int, out: str) -> None:
    retain_freed_memory()  # (as every process of hetero's command does: a step's buffers are not faulted in again)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    job = ps.PSJob.init(ps.PSConfig(num_servers=world - 1, timeout_s=300))
    torch.manual_seed(0)
    table = HostEmbedding(TableConfig("t", ROWS, D))
    job.shard_tables(table)
    opt = LazyAdam([table])
    job.start(table, {"t": opt})
    if job.role is ps.Role.WORKER:
        client = table.group.exchange
        grad = torch.randn(B * F, D)

        def step(ids):
            client.pull(ids)
            # this step's lookup with its gradient rows, as a pulled lookup's backward leaves it (capture.HostPool)
            lookup = LookupGrad(ids)
            lookup.pending.add(SparseGrad(ids, grad[: ids.numel()], RowSpace.GROUP))
            client.lookups = [lookup]
            client.push()

        rate = median_rate(step, batches(steps + warmup), warmup)
        Path(out).write_text(json.dumps(rate))
    job.shutdown()
    shutdown()


def ps_rate(servers: int, steps: int, warmup: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # One thread per process, as torchrun sets for several processes per host: idle OpenMP
    # threads spin for a while after each parallel region and would starve the other processes.
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")  # inherited by the spawned interpreters
    try:
        with tempfile.TemporaryDirectory() as d:
            out = str(Path(d) / "rate.json")
            mp.spawn(_rank, args=(servers + 1, port, steps, warmup, out), nprocs=servers + 1)
            return json.loads(Path(out).read_text())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--servers", default="1,2,4")
    p.add_argument("--name", default="ps", help="the result's name (results/NAME_cpu.json)")
    args = p.parse_args()
    retain_freed_memory()  # (the in-process side as the servers and the worker: _rank)
    local = local_rate(args.steps, args.warmup)
    # issue #39's measure: in process with the thread count of a server process (one)
    local_one = local_rate(args.steps, args.warmup, threads=1)
    print(f"local: {local / 1e6:.2f} M rows/s, one thread {local_one / 1e6:.2f}", file=sys.stderr)
    rates = {}
    for s in (int(x) for x in args.servers.split(",")):
        rates[str(s)] = ps_rate(s, args.steps, args.warmup)
        print(f"{s} servers: {rates[str(s)] / 1e6:.2f} M rows/s", file=sys.stderr)
    emit(args.name, {"ps_rows_per_s": rates, "local_rows_per_s": local, "table": [ROWS, D], "ids_per_step": B * F,
                "unique_rows_per_step": int(batches(1)[0].numel()), "optimizer": "lazy_adam", "workers": 1,
                "local_one_thread_rows_per_s": local_one,
                "ratio_to_local": {k: v / local for k, v in rates.items()},
                "ratio_to_local_one_thread": {k: v / local_one for k, v in rates.items()}, "cpu": cpu()})


if __name__ == "__main__":
    main()
