"""One place that loads numba kernel modules: lazily, thread-safe, with hetero's thread count.

``import hetero`` never imports numba; the first kernel call does. numba's default threading layer
(workqueue) aborts when two threads launch parallel kernels at once, which hetero does (a prefetch
worker, a host optimizer overlapping backward), so the thread-safe layer (OpenMP or TBB) is asked
for unless ``NUMBA_THREADING_LAYER`` is set. Kernels use ``torch.get_num_threads()`` threads
(which honours ``OMP_NUM_THREADS``) unless :func:`set_num_threads` says otherwise.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

_threads: int | None = None


def start_pool(threads: int) -> None:
    """Size numba's thread pool for a process whose threads run ``threads`` at most (once per
    process) and start its threading layer on the calling thread. A host worker
    (:func:`hetero.placement.threads.host_worker`) calls this on the thread that starts it: the
    layer's start sets the OpenMP thread count of the thread it starts on, which on the worker
    would undo the worker's own (one thread beside a CPU device)."""
    _size_pool(threads)
    numba = _numba()
    numba.set_num_threads(min(max(_threads or 1, threads), numba.config.NUMBA_NUM_THREADS))


def _size_pool(threads: int) -> None:
    # numba's thread pool no larger than torch's: under torchrun (OMP_NUM_THREADS=1 per process)
    # idle pool threads spin after each kernel and take the cores of the job's other processes
    # (measured: parameter-server pulls 3x slower with 3 processes on 2 cores). numba reads the
    # size from the environment, at import and again whenever it compiles, so the variable stays
    # set (processes started from this one inherit it unless they set their own).
    # A smaller set_num_threads() in effect at the first call does not shrink the pool: a later
    # larger one would be capped for the life of the process.
    os.environ.setdefault("NUMBA_NUM_THREADS", str(max(_threads or 1, threads, 1)))


@functools.cache
def _numba() -> ModuleType:
    _size_pool(torch.get_num_threads())
    import numba
    import numba.core.config

    # numba reads its environment at import: a process forked from one that imported it before the
    # size was set (a fork server's preload) holds the parent's size, and would launch its pool with
    # it, then fail at its next compile ("Cannot set NUMBA_NUM_THREADS ... once the threads have been
    # launched"). Nothing has launched the pool yet here: read the environment again now.
    numba.core.config.reload_config()

    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "threadsafe"
    return numba


def num_threads() -> int:
    numba = _numba()
    return min(_threads or torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)


def load(module: str) -> ModuleType:
    """Import kernel module ``module`` (compiling on first use) with the thread count applied."""
    numba = _numba()
    mod = importlib.import_module(module)
    want = num_threads()
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)  # thread-local in numba: set for each calling thread
    return mod


def set_num_threads(n: int | None) -> None:
    """Threads for hetero's host kernels; ``None`` restores the default (``torch.get_num_threads()``).

    numba's thread pool is sized by the first kernel call (``NUMBA_NUM_THREADS``, default the
    larger of ``torch.get_num_threads()`` and the count set then); later calls use at most that
    many threads.

    Raises:
        ValueError: ``n < 1``.
    """
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"host kernel threads must be >= 1, got {n}")
    _threads = n
