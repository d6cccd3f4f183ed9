"""Can a worker thread hide the DLRM step's sparse update in the cores its dense step leaves idle?
(issue #39, target 2, on a host without an accelerator: the measured limit).

The DLRM of ``benchmarks/dlrm_step.py`` (26 tables of ``--rows`` x 16, row-wise Adagrad; the
reference implementation's Criteo shape). Each item is one DLRM step's forward, backward and
Adam step, its row-wise Adagrad update, and one step of the same model with fixed embeddings (the
dense part alone, a stand-in for the dense work an overlapped update would run beside):

* ``serial``: the update, then the dense step, on the training thread;
* ``overlapped``: the update submitted to a host worker (``hetero.placement.threads.host_worker``,
  one OpenMP thread), the dense step run meanwhile, then the update joined;
* ``overlapped_idle``: the same with the worker's update under ``SCHED_IDLE`` (Linux: it runs only on a
  core nothing else wants, so it cannot slow the dense step's two threads).

``overlapped / serial`` below 1 is what overlap could win; the update's own time is ``update``
(the step with its update over the step without). In one process, the ways in turn, medians.

    python benchmarks/dlrm_overlap.py --rows 1000000
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu, emit  # noqa: E402
from _workload import in_turn  # noqa: E402
from dlrm_step import B, arguments, batches, build  # noqa: E402

from hetero.placement.threads import host_worker  # noqa: E402


def _update(sparse, policy: int) -> None:  # noqa: ANN001
    """``sparse.step()`` on the calling (worker) thread under scheduling ``policy``."""
    os.sched_setscheduler(0, policy, os.sched_param(0))  # (0: the calling thread)
    sparse.step()


def main() -> None:
    args = arguments(__doc__, "dlrm_overlap")
    _, full = build(args.rows, False)
    _, dense = build(args.rows, True)
    work = batches("zipf", args.rows, args.block * (args.blocks + 1))
    # (one worker for both ways: each worker's OpenMP team counts towards the process's threads)
    pool = host_worker("hetero-overlap")

    def serial(part) -> None:  # noqa: ANN001
        for b in part:
            full(b)
            dense(b)

    def overlapped(policy: int):  # noqa: ANN202
        def run(part) -> None:  # noqa: ANN001
            for b in part:
                started = []
                full(b, update=lambda sparse: started.append(pool.submit(_update, sparse, policy)))
                dense(b)
                started.pop().result()  # sync point: the update done before the next step's lookups
        return run

    def no_update(part) -> None:  # noqa: ANN001
        for b in part:
            full(b, update=lambda sparse: None)
            dense(b)

    runs = {"serial": serial, "overlapped": overlapped(os.SCHED_OTHER),
            "overlapped_idle": overlapped(os.SCHED_IDLE), "no_update": no_update}
    serial(work[: args.block])  # warm-up (numba's kernels compile, the allocator settles)
    for r in ("overlapped", "overlapped_idle"):
        runs[r](work[: args.block])
    parts = [work[args.block * (i + 1): args.block * (i + 2)] for i in range(args.blocks)]
    ms = {k: v * 1e3 for k, v in in_turn(runs, parts).items()}
    pool.shutdown()
    result = {"rows_per_table": args.rows, "batch_size": B, "ids": "zipf", "block": args.block,
              "threads": torch.get_num_threads(), "cpu": cpu(),
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
              "ms_per_item": ms, "update_ms": ms["serial"] - ms["no_update"],
              "overlapped_over_serial": ms["overlapped"] / ms["serial"],
              "overlapped_idle_over_serial": ms["overlapped_idle"] / ms["serial"]}
    emit(args.name, result)


if __name__ == "__main__":
    main()
