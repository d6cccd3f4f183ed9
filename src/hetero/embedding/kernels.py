"""Lazy access to the host kernels and their thread count.

``import hetero`` does not import numba; the first lookup or optimizer step does, and numba
compiles each kernel once (cached on disk next to the module, so later processes skip it).

Threads: numba's parallel kernels use ``num_threads`` threads, by default
``torch.get_num_threads()`` (which honours ``OMP_NUM_THREADS``). :func:`set_num_threads` changes it.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

_threads: int | None = None


@functools.cache
def _module() -> ModuleType:
    import numba

    from hetero.embedding import _numba_kernels

    _numba_kernels.num_threads = numba.get_num_threads
    return _numba_kernels


def kernels() -> ModuleType:
    """The compiled kernels module, with numba's thread count applied."""
    mod = _module()
    import numba

    want = min(_threads or torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)  # thread-local in numba: set for each calling thread
    return mod


def set_num_threads(n: int | None) -> None:
    """Threads for the host kernels; ``None`` restores the default (``torch.get_num_threads()``).

    Raises:
        ValueError: ``n < 1``.
    """
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"host kernel threads must be >= 1, got {n}")
    _threads = n
