"""Id batches and step timing shared by the embedding benchmarks, numpy and the standard library
only: the peers benchmark (``benchmarks/peers/``) runs them in environments without hetero."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np


def id_arrays(dist: str, rows: int, count: int, shape: tuple[int, int], seed: int = 0) -> list[np.ndarray]:
    """``count`` int64 id batches of ``shape``: uniform over ``[0, rows)``, or Zipf(1.05) with the hot
    ids scattered over the table by a fixed permutation. The same arrays in every process."""
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        return [rng.integers(0, rows, shape) for _ in range(count)]
    perm = rng.permutation(rows)
    return [perm[(rng.zipf(1.05, shape) - 1) % rows] for _ in range(count)]


def timed(step: Callable, batches: Sequence, warmup: int, block: int = 5) -> float:
    """Seconds per step: the median over blocks of ``block`` steps of ``batches[warmup:]`` (the
    median of blocks resists the bursts of a shared machine better than one long mean)."""
    for b in batches[:warmup]:
        step(b)
    times = []
    rest = batches[warmup:]
    for i in range(0, len(rest) - block + 1, block):
        t0 = time.perf_counter()
        for b in rest[i : i + block]:
            step(b)
        times.append((time.perf_counter() - t0) / block)
    return float(np.median(times))


def in_turn(runs: dict[str, Callable[[Sequence], object]], parts: Sequence[Sequence]) -> dict[str, float]:
    """Seconds per item of each of ``runs`` (``run(part)`` handles every item of ``part``), all
    in one process: each part handed to every run in turn, which one first rotating part by part,
    the median over the parts. The sides of a ratio see the same machine (a VM's speed can move
    by half between processes)."""
    return {k: float(np.median(v)) for k, v in in_turn_seconds(runs, parts).items()}


def in_turn_seconds(runs: dict[str, Callable[[Sequence], object]], parts: Sequence[Sequence]) -> dict[str, list[float]]:
    """:func:`in_turn`'s seconds per item of every part, in the parts' order: a ratio of two runs
    is best the median of their ratios part by part, each pair timed within moments."""
    seconds: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for i, part in enumerate(parts):
        for name in order[i % len(order):] + order[: i % len(order)]:
            t0 = time.perf_counter()
            runs[name](part)
            seconds[name].append((time.perf_counter() - t0) / len(part))
    return seconds


def serve(step: Callable, batches: Sequence, warmup: int) -> None:
    """Time blocks of steps on request, for a coordinator that interleaves several processes
    (``benchmarks/peers/run.py``): after the warm-up, print ``ready``; then for every line ``n`` read
    from stdin, run ``n`` steps over ``batches[warmup:]`` (cycling) and print their seconds per
    step. Returns at end of input. Each system keeps a process (and an environment) of its own, yet
    the systems take turns every few steps, so both sides of a ratio see the same machine."""
    import sys

    for b in batches[:warmup]:
        step(b)
    rest, i = batches[warmup:], 0
    print("ready", flush=True)
    for line in sys.stdin:
        n = int(line)
        t0 = time.perf_counter()
        for _ in range(n):
            step(rest[i % len(rest)])
            i += 1
        print((time.perf_counter() - t0) / n, flush=True)
