"""Lazy access to the embedding engine's numba kernels (see :mod:`hetero._numba`): the row kernels
(:func:`kernels`) and the dedup and read-after-write kernels (:func:`dedup_kernels`)."""

from __future__ import annotations

from types import ModuleType

from hetero._numba import num_threads, set_num_threads
from hetero._numba import load as _load

__all__ = ["dedup_kernels", "kernels", "num_threads", "set_num_threads"]


def kernels() -> ModuleType:
    """The compiled kernels module, with the thread count applied for the calling thread."""
    mod = _load("hetero.embedding._numba_kernels")
    mod.num_threads = num_threads
    return mod


def dedup_kernels() -> ModuleType:
    """The compiled dedup kernels module, with the thread count applied for the calling thread."""
    mod = _load("hetero.embedding._numba_dedup")
    return mod
