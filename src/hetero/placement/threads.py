"""Worker threads for host work beside the calling thread: their OpenMP team, and the thread-local
state they take over from the thread they work for.

**The team** (:func:`host_worker`). torch's intra-op pool and numba's threadsafe layer are
OpenMP: each thread that runs a parallel region keeps a team of threads for as long as it lives.
Once the process's teams hold more threads than there are cores, GNU libgomp stops spinning
between parallel regions, and every region of every thread pays a futex sleep and wake-up -
measured on 2 cores: torch's AdamW step over 3.3M parameters on the main thread 4.2 ms alone,
33 ms once a worker thread that ran one parallel op (torch's or a numba kernel) is alive
(``benchmarks/worker_threads.py``). Where the device is the CPU, the calling thread's team holds
the cores, so a host worker runs one thread; beside an accelerator it takes torch's count.

**The state** (:class:`ThreadContext`). Grad mode, the current CUDA device and stream, and
autocast are per thread in PyTorch: a host subgraph run on the partitioner's worker, or a
prefetch on the prefetcher's, would otherwise run in fp32 outside the caller's
``torch.autocast``, on device 0 and on the default stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from hetero.placement.target import Target, resolve_device
from hetero._numba import start_pool

_AUTOCAST_DEVICES = ("cpu", "cuda")
FEW_CORES = 2  # at most this many cores: one compute thread by default (default_compute_threads)


def default_compute_threads() -> int:
    """The default count of compute threads (torch's intra-op pool and hetero's host kernels):
    one where this process may use at most :data:`FEW_CORES` cores, else torch's own default.

    Measured on a 2-core host (the MovieLens demo, 2 epochs; ``hetero train --threads``): idle,
    2 threads ran 36-42k samples/s against 34k with 1; with the other core busy, 2 threads ran
    6.5k against 27.7k with 1 (32 s against 8.7 s: OpenMP's team of 2 waits for the busy core at
    every parallel region; the issue's TalkingData job: 40-48 s against 11-13 s). One thread loses
    at most a sixth on an idle 2-core host and saves 3-4x on a busy one.
    """
    return 1 if available_cores() <= FEW_CORES else torch.get_num_threads()


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; elsewhere than Linux, the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class ThreadContext:
    """A snapshot of the calling thread's grad mode, CUDA device and stream, and autocast."""

    grad: bool
    cuda_device: int | None  # None: CUDA not in use by the caller
    cuda_stream: Any  # torch.cuda.Stream or None
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) of each enabled autocast

    @staticmethod
    def capture() -> "ThreadContext":
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # never initialises CUDA itself
        autocast = tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d))
        return ThreadContext(torch.is_grad_enabled(), torch.cuda.current_device() if cuda else None,
                             torch.cuda.current_stream() if cuda else None, autocast)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Enter this state on the current (worker) thread."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad))
            if self.cuda_device is not None:
                stack.enter_context(torch.cuda.device(self.cuda_device))
                stack.enter_context(torch.cuda.stream(self.cuda_stream))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            yield


def worker_threads() -> int:
    """The threads of a host worker's OpenMP team: 1 where the device is the CPU (the calling
    thread's team holds the cores), else ``torch.get_num_threads()``."""
    return 1 if resolve_device(Target.DEVICE).type == "cpu" else torch.get_num_threads()


def host_worker(name: str) -> ThreadPoolExecutor:
    """A one-thread pool for host work beside the calling thread, its thread named ``name`` and
    its OpenMP team of :func:`worker_threads` threads (see the module docstring); torch's and
    numba's kernels on it use that many. Started here (the caller waits for it to start; numba's
    threading layer is started on the caller, and ``torch.set_num_threads`` is called there with
    the caller's own count, which sets that of threads started later back to it)."""
    threads, own = _start_numba()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=_size_team, initargs=(own,))
    pool.submit(int).result()  # the worker starts and sizes its own team
    _restore(threads)
    return pool


def host_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread running ``target`` beside the calling thread (a producer), its OpenMP team
    sized as :func:`host_worker`'s; started here."""
    threads, own = _start_numba()
    sized = threading.Event()

    def run() -> None:
        _size_team(own)
        sized.set()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    sized.wait()
    _restore(threads)
    return thread


def _start_numba() -> tuple[int, int]:

    threads = torch.get_num_threads()
    start_pool(threads)  # numba's kernels are OpenMP too: their layer started here, not on the worker
    return threads, worker_threads()


def _restore(threads: int) -> None:
    # torch.set_num_threads also sets the count threads started afterwards take: the caller's again
    torch.set_num_threads(threads)


def _size_team(threads: int) -> None:
    # torch sizes a thread's team from the process-wide count at the thread's first parallel op,
    # once: that first (get_num_threads), so the size set next is this thread's for good
    torch.get_num_threads()
    torch.set_num_threads(threads)
