"""What a parameter server's messages can move between two processes of this host (issue #39,
target 3): torch.distributed point-to-point on each backend this torch build has for CPU tensors
(``send``/``recv`` of one message there and one back, the PS's request and reply), against a
copy of the same bytes within one process (``Tensor.copy_``: what an in-process table pays to
hand rows over). The PS moves, per unique row of a step, its id and its row there and its
gradient back; this bounds its rows/s at one server from the transport alone.

And what a message costs whatever its size: the round trip of a 64-byte message each way, and of
two each way (the PS's request and reply were 2-3 messages each before they became one), on gloo;
torch.distributed.rpc's TensorPipe agent (the other same-host transport of a CPU build: its ``shm``
and ``uv`` transports) echoing 64 bytes and 1 MiB; and a plain loopback TCP socket (what the
operating system allows).

    python benchmarks/ps_transport.py
"""

from __future__ import annotations

import os
import socket
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
TRIPS = 300  # round trips of small messages timed


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
    small = torch.zeros(8, dtype=torch.int64)  # 64 bytes: a request's header
    for k in (1, 2):  # k messages there, k back
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(TRIPS):
            for _ in range(k):
                dist.send(small, 1) if rank == 0 else dist.recv(small, 0)
            for _ in range(k):
                dist.recv(small, 1) if rank == 0 else dist.send(small, 0)
        result[f"round_trip_s_{k}_each_way"] = (time.perf_counter() - t0) / TRIPS
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


def point_to_point(backend: str) -> dict[int, float]:
    """Bytes/s of a round trip of each message size between two processes on ``backend``."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.pt")
        mp.start_processes(_rank, args=(backend, f"file://{d}/rendezvous", out), nprocs=2, start_method="spawn")
        return torch.load(out)


def _rpc_rank(rank: int, transport: str, init: str, out: str) -> None:
    from torch.distributed import rpc

    # (``_transports``: TensorPipe's choice of transport, a private option of its backend)
    options = rpc.TensorPipeRpcBackendOptions(init_method=init, num_worker_threads=2, _transports=[transport])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        result = {}
        for size in (64, 1 << 20):
            x = torch.zeros(size, dtype=torch.uint8)
            for _ in range(10):
                rpc.rpc_sync("w1", torch.clone, args=(x,))  # (a builtin: the other side runs it, sends it back)
            t0 = time.perf_counter()
            for _ in range(TRIPS):
                rpc.rpc_sync("w1", torch.clone, args=(x,))
            result[str(size)] = (time.perf_counter() - t0) / TRIPS
        torch.save(result, out)
    rpc.shutdown()


def rpc_echo(transport: str) -> dict[str, float] | str:
    """Seconds of an ``rpc_sync`` echo of 64 bytes and of 1 MiB on TensorPipe's ``transport``, or why not."""
    try:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "result.pt")
            mp.start_processes(_rpc_rank, args=(transport, f"file://{d}/rendezvous", out), nprocs=2,
                               start_method="spawn")
            return torch.load(out)
    except Exception as e:  # noqa: BLE001 - a transport this build or host lacks: recorded, not fatal
        return f"unavailable: {type(e).__name__}: {str(e)[:200]}"


def _echo_server(sock: socket.socket) -> None:
    conn, _ = sock.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(64):
        conn.sendall(data)


def tcp_round_trip() -> float:
    """Seconds of a 64-byte round trip over a plain loopback TCP socket between two processes."""
    sock = socket.create_server(("127.0.0.1", 0))
    proc = mp.get_context("fork").Process(target=_echo_server, args=(sock,))
    proc.start()
    with socket.create_connection(sock.getsockname()) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        message = b"x" * 64
        t0 = time.perf_counter()
        for _ in range(10 * TRIPS):
            c.sendall(message)
            got = 0
            while got < 64:
                got += len(c.recv(64 - got))
        seconds = (time.perf_counter() - t0) / (10 * TRIPS)
    proc.join()
    return seconds


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
        measured = point_to_point(backend)
        result[f"{backend}_bytes_per_s"] = {str(k): v for k, v in measured.items() if isinstance(k, int)}
        result[f"{backend}_round_trip_s"] = {k.split("_s_")[1]: v for k, v in measured.items() if isinstance(k, str)}
    result["tcp_round_trip_s"] = tcp_round_trip()
    result["rpc_echo_s"] = {t: rpc_echo(t) for t in ("shm", "uv")}
    top = str(SIZES[-2])  # 4 MiB: about a step's rows of benchmarks/ps.py (100k unique rows x 16 fp32 = 6.4 MB)
    result["gloo_over_copy_4mib"] = result["gloo_bytes_per_s"][top] / result["copy_bytes_per_s"][top]
    emit("ps_transport", result)


if __name__ == "__main__":
    main()
