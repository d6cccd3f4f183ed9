"""Host workers beside a CPU device: one OpenMP thread for torch's ops and numba's kernels on the
worker (after either ran there), the caller's count unchanged and taken by threads started
later, numba's pool sized for the process. Each case in a fresh process: numba's threading layer starts once per process, and which
thread starts it is what the case is about."""

import subprocess
import sys

import pytest
import torch

CASE = """
import threading, numpy as np, torch
torch.set_num_threads(2)
from hetero.placement.threads import host_thread, host_worker, worker_threads
from hetero.embedding.kernels import kernels
{before}

def work():
    seen = [torch.get_num_threads()]
    (torch.rand(1 << 20) * 2).sum()  # a parallel torch op
    out = np.zeros((64, 16), dtype=np.float32)
    kernels().pool_forward(np.random.rand(4096, 16).astype(np.float32), np.arange(4096),
                           np.arange(0, 4097, 64), np.empty(0, dtype=np.float32), out)  # a parallel numba kernel
    import numba
    return seen + [torch.get_num_threads(), numba.get_num_threads()]

later = []
t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
{run}
t.start(); t.join()
import numba
print(worker_threads(), on_worker, torch.get_num_threads(), later, numba.config.NUMBA_NUM_THREADS)
"""


POOL = "on_worker = host_worker('hetero-test').submit(work).result()"
THREAD = "box = []; host_thread(lambda: box.append(work()), 'hetero-test').join(); on_worker = box[0]"


def _run(before: str = "", run: str = POOL, cpu: bool = True) -> str:
    """The case's line, in a fresh process whose device is the CPU (GPUs hidden; ``cpu``)."""
    import os

    # the thread counts are the case's own (torch.set_num_threads(2)): none inherited from the suite's
    # environment (a GPU run's OMP_NUM_THREADS=1 capped numba's pool at 1, run 9)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", CASE.format(before=before, run=run)], capture_output=True, text=True,
                          timeout=300, env={**env, **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_a_host_worker_runs_one_thread_beside_a_cpu_device():
    # numba first used on the worker (HostAdamW's overlapped update): its start must not resize the worker
    # (and numba's pool sized for the process, not the worker: the caller's kernels take 2)
    assert _run() == "1 [1, 1, 1] 2 [2] 2"


def test_a_host_worker_after_numba_started_on_the_caller():
    assert _run("kernels(); import numba; numba.set_num_threads(2)") == "1 [1, 1, 1] 2 [2] 2"


def test_a_host_thread_runs_one_thread_beside_a_cpu_device():
    assert _run(run=THREAD) == "1 [1, 1, 1] 2 [2] 2"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_host_worker_beside_a_gpu_takes_the_callers_count():
    # beside an accelerator the calling thread's team does not hold the cores: the worker's takes torch's count
    # (seen on an H100 machine, 2026-11-25)
    assert _run(cpu=False) == "2 [2, 2, 2] 2 [2] 2"
    assert _run(run=THREAD, cpu=False) == "2 [2, 2, 2] 2 [2] 2"
