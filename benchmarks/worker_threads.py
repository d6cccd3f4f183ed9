"""A host worker thread beside the main thread: what its OpenMP team costs the main thread's ops.

Same run, same machine: torch's AdamW step (3.3M parameters in 57 tensors, the GPT example's
shapes) on the main thread (1) alone, (2) while a plain one-thread ``ThreadPoolExecutor`` worker
that ran one torch op and one numba kernel is alive (hetero's workers before
``hetero.placement.threads.host_worker``), (3) the same with ``host_worker``. Each case is the
median of 12 steps after 3, in rounds alternating the cases (the plain worker is shut down after
its case: a thread's OpenMP team lives as long as the thread). On 2 cores, GNU libgomp stops
spinning once the teams hold more threads than cores, and every parallel region pays a futex
sleep and wake-up.

    python benchmarks/worker_threads.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

from hetero.placement.threads import host_worker, worker_threads  # noqa: E402


def adamw_step_ms(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> float:
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[3:])


def host_work() -> None:
    """One torch op and one numba kernel on the calling thread (what a host worker runs)."""
    from hetero.embedding.kernels import kernels

    (torch.rand(1 << 20) * 2 + 1).sum()
    rows = np.random.rand(4096, 16).astype(np.float32)
    kernels().pool_forward(rows, np.arange(4096, dtype=np.int64), np.arange(0, 4097, 64, dtype=np.int64),
                           np.empty(0, dtype=np.float32), np.zeros((64, 16), dtype=np.float32))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    params = [torch.nn.Parameter(torch.rand(3320320 // 57)) for _ in range(57)]
    for q in params:
        q.grad = torch.rand_like(q)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    cases: dict[str, list[float]] = {"alone": [], "plain_worker": [], "host_worker": []}
    for _ in range(args.rounds):
        cases["alone"].append(adamw_step_ms(params, opt))
        with ThreadPoolExecutor(max_workers=1) as plain:
            plain.submit(host_work).result()
            cases["plain_worker"].append(adamw_step_ms(params, opt))
        with host_worker("hetero-bench") as pool:
            pool.submit(host_work).result()
            cases["host_worker"].append(adamw_step_ms(params, opt))
    best = {k: min(v) for k, v in cases.items()}
    for k, v in cases.items():
        print(f"{k}: AdamW step {best[k]:.2f} ms (rounds {[round(x, 2) for x in v]})", file=sys.stderr)
    emit("worker_threads", {
        "worker_team_threads": worker_threads(), "main_threads": torch.get_num_threads(),
        "adamw_step_ms": best,
        "slowdown_plain_worker": best["plain_worker"] / best["alone"],
        "slowdown_host_worker": best["host_worker"] / best["alone"],
    })


if __name__ == "__main__":
    main()
