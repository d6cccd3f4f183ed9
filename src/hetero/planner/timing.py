"""The measurements behind a :class:`~hetero.planner.calibration.Calibration`: timing with
repeats, op curves per family (on the calling thread, or on a worker thread as host subgraphs
run), copies, optimizer and table kernel rates, hand-offs, an op's eager overhead, exact-shape
replays and collectives. Each function measures one thing on this machine; nothing is cached
here.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from hetero.planner.calibration_types import Curve, LinearRate, TableRate
from hetero.planner.graph import ModelGraph, OpFamily
from hetero.placement import Target, resolve_device
from hetero.planner.graph import TensorSpec, op_flops
from hetero.placement.threads import host_worker
from hetero.optim import (
    HostAdamW,
    HostOffloadConfig,
    DEVICE_SPARSE_OPTIMIZERS,
    SparseOptimizerKind,
    device_sparse_optimizer,
)
from hetero.optim.fused import fused_on_cuda
from hetero.embedding import HostEmbeddingCollection, TableConfig, move_tables_to_device


def timed(fn: Callable[[], object], device: torch.device, budget_s: float = 0.05, max_repeats: int = 50) -> float:
    """Seconds of ``fn()``: the lower quartile over repeats filling about ``budget_s`` (after one
    warm-up) - a shared machine's noise only ever slows a run, so the quartile is the op's own
    speed; on CUDA each repeat is bracketed by synchronisations (sync points: the kernels' time)."""
    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    first = once()
    times = [once()]
    repeats = min(max_repeats, max(2, int(budget_s / max(times[0], first, 1e-7))))
    times += [once() for _ in range(repeats - 1)]
    return statistics.quantiles(times, n=4)[0] if len(times) >= 4 else min(times)


def time_replays(calibration: Any, graph: ModelGraph, todo: list[tuple[str, str]]) -> None:  # noqa: ANN401

    for target, sig in todo:
        device = resolve_device(Target.HOST if target == "host" else Target.DEVICE)
        replay = graph.replays[sig]
        args, kwargs = _materialise((replay.args, replay.kwargs), device)

        def run(replay: Any = replay, args: Any = args, kwargs: Any = kwargs) -> object:  # noqa: ANN401
            return replay.op(*args, **kwargs)

        try:
            seconds = timed(run, device, budget_s=0.01, max_repeats=10)
        except Exception:  # noqa: BLE001 - an op that needs real values (an index, a shape): the curve serves
            seconds = float("nan")
        calibration.shapes[target][sig] = seconds


def _materialise(tree: Any, device: torch.device) -> Any:  # noqa: ANN401 - a pytree of replay arguments
    """Replay arguments with random tensors of their specs on ``device``."""
    from torch.utils import _pytree as pytree


    def make(x: Any) -> Any:  # noqa: ANN401
        if not isinstance(x, TensorSpec):
            return x
        size = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride)) if all(x.shape) else 0
        base = torch.rand(max(size, 1), device=device).to(x.dtype) if x.dtype.is_floating_point else \
            torch.zeros(max(size, 1), dtype=x.dtype, device=device)
        return base.as_strided(x.shape, x.stride)

    return pytree.tree_map(make, tree)


def eager_seconds_per_op(device: torch.device) -> float:
    """Seconds per aten op of a chain of small elementwise ops run forward and backward from
    Python under autograd (what a model's many small ops cost beyond their kernels)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.rand(16, device=device, requires_grad=True)

    def run() -> None:
        y = x
        for _ in range(25):
            y = torch.relu(y * 1.0001 + 0.0001)
        y.sum().backward()

    count = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            count[0] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    return timed(run, device, budget_s=0.1) / count[0]


def _flops(fn: Callable[[], object]) -> int:
    """FLOPs of the aten ops ``fn`` runs, counted as the capture counts them."""
    from torch.utils._python_dispatch import TorchDispatchMode


    total = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            total[0] += op_flops(func, args, kwargs or {}, out)
            return out

    with Count():
        fn()
    return total[0]


@contextlib.contextmanager
def worker() -> Iterator[Callable[..., Callable[[], object]]]:
    """``wrap(fn, k=1)``: a function running ``fn`` ``k`` times in a row on one worker thread the
    caller waits on (how the partitioner runs host subgraphs: a host worker, its thread team
    sized as theirs); the thread ends with the block."""

    with host_worker("hetero-calibration") as pool:
        def wrap(fn: Callable[[], object], k: int = 1) -> Callable[[], object]:
            return lambda: pool.submit(lambda: [fn() for _ in range(k)]).result()

        yield wrap


def handoff_seconds() -> float:
    """Seconds of handing a small task to a worker thread and waiting for it, right after work on
    the calling thread (a host subgraph after device work: the worker's thread team has gone to
    sleep and wakes up), beyond the task's own time."""
    a, b = torch.rand(64, 64), torch.rand(512, 512)
    with worker() as wrap:
        on_worker = wrap(lambda: a @ a)

        def after_work() -> float:
            b @ b  # the caller's own work first
            t0 = time.perf_counter()
            on_worker()
            return time.perf_counter() - t0

        for _ in range(5):
            after_work()
        waited = statistics.median(after_work() for _ in range(40))
    return max(0.0, waited - timed(lambda: a @ a, torch.device("cpu"), budget_s=0.02))


def op_curves(device: torch.device) -> dict[str, Curve]:
    """Each op family's :class:`Curve` on ``device`` (see the module docstring): two passes over
    the shapes, a moment apart, each point the faster pass's."""
    first, second = _op_points(device), _op_points(device)
    return {k: Curve.through([(w, min(a, b)) for (w, a), (_, b) in zip(first[k], second[k])]) for k in first}


def _op_points(device: torch.device) -> dict[str, list[tuple[float, float]]]:
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g, device=device)

    out: dict[str, list[tuple[float, float]]] = {f.value: [] for f in OpFamily}
    for m, k, n in [(8, 8, 8), (32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512),
                    (1024, 1024, 1024), (1536, 1536, 1536), (2048, 64, 64), (4096, 256, 256), (256, 1024, 4096),
                    (32, 784, 512), (8192, 128, 64)]:
        a, b = rand(m, k), rand(k, n)
        out["matmul"].append((2 * m * k * n, timed(lambda: a @ b, device)))
    for cin, cout, hw, kernel, stride in [(3, 64, 32, 7, 2), (16, 16, 8, 3, 1), (64, 64, 16, 1, 1), (64, 64, 16, 3, 1),
                                          (64, 256, 8, 1, 1), (128, 128, 8, 3, 1), (256, 256, 4, 3, 1),
                                          (512, 512, 2, 3, 1), (1024, 256, 2, 1, 1), (256, 64, 16, 1, 1)]:
        x, w = rand(8, cin, hw, hw), rand(cout, cin, kernel, kernel)
        y = F.conv2d(x, w, stride=stride, padding=kernel // 2)
        fwd = lambda: F.conv2d(x, w, stride=stride, padding=kernel // 2)  # noqa: E731
        bwd = lambda: torch.ops.aten.convolution_backward(  # noqa: E731
            y, x, w, None, [stride] * 2, [kernel // 2] * 2, [1, 1], False, [0, 0], 1, [True, True, False])
        out["conv"].append((_flops(fwd), timed(fwd, device)))
        out["conv_backward"].append((_flops(bwd), timed(bwd, device)))
    for b, h, t, d in [(2, 2, 32, 32), (4, 4, 64, 32), (8, 4, 128, 64), (8, 8, 256, 64), (4, 8, 512, 64)]:
        q, k_, v = (rand(b, h, t, d).requires_grad_() for _ in range(3))
        fwd = lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True)  # noqa: E731
        y = fwd()
        grad = torch.ones_like(y)
        bwd = lambda: torch.autograd.grad(y, (q, k_, v), grad, retain_graph=True)  # noqa: E731
        out["attention"].append((_flops(fwd), timed(fwd, device)))
        out["attention"].append((_flops(bwd), timed(bwd, device)))
    for n in [1 << 8, 1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]:
        a, b, c = rand(n), rand(n), rand(n)
        out["memory"].append((12 * n, timed(lambda: torch.add(a, b, out=c), device)))
    a = rand(64)
    out["view"].append((1, timed(lambda: [a.view(8, 8) for _ in range(100)], device) / 100))
    return out


def copy_curves(device: torch.device) -> tuple[Curve, Curve]:
    up, down = [], []
    for n in [1 << 12, 1 << 16, 1 << 20, 1 << 24]:
        host = torch.empty(n, dtype=torch.uint8).pin_memory()
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        up.append((n, timed(lambda: dev.copy_(host, non_blocking=True), device)))
        down.append((n, timed(lambda: host.copy_(dev, non_blocking=True), device)))
    return Curve.through(up), Curve.through(down)


def op_scratch(device: torch.device) -> tuple[tuple[int, int], ...]:
    """(bytes reduced, device bytes of scratch) of a sum over dimension 0 - a bias gradient's, over
    the batch - at a few activation shapes: what the op takes from the caching allocator beyond
    its output and frees before it returns. CUDA's multi-block reductions keep partial sums in a
    global buffer that sits, at a step's peak in backward, on top of every tensor the cost model
    counts: on an H200 (torch 2.11) two plans measured 2.0 MB over their predictions, a 2 MiB
    reduction buffer of a (2048, 256) gradient (GPU run 12, session 30). Empty without an
    accelerator (the meter counts tensors there, not a kernel's scratch). Resets the allocator's
    peak statistics (calibration only)."""
    if device.type != "cuda":
        return ()
    points = []
    for rows, cols in ((1024, 64), (2048, 256), (4096, 1024), (8192, 2048)):
        t = torch.randn(rows, cols, device=device)
        torch.cuda.synchronize(device)  # sync point: the allocator's count after the work queued
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = t.sum(0)
        torch.cuda.synchronize(device)
        scratch = torch.cuda.max_memory_allocated(device) - before - -(-out.nbytes // 512) * 512  # (blocks of 512 B)
        points.append((t.nbytes, max(0, scratch)))
        del t, out
    return tuple(points)


def _fit(rows: list[tuple[float, ...]], seconds: list[float]) -> np.ndarray:
    """Least-squares coefficients (non-negative where the data allow) of ``seconds ~ rows``."""
    coef, *_ = np.linalg.lstsq(np.array(rows, dtype=np.float64), np.array(seconds), rcond=None)
    return np.maximum(coef, 0.0)


def optimizer_rate(device: torch.device, kind: str) -> LinearRate:
    rows, seconds = [], []
    for total, tensors in [(1 << 16, 4), (1 << 20, 4), (1 << 22, 8), (1 << 20, 64), (1 << 16, 64)]:
        params = [torch.nn.Parameter(torch.rand(total // tensors, device=device)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.rand_like(p)
        fused = fused_on_cuda(params)  # (the implementation hetero.apply's device optimizer uses)
        opt = torch.optim.AdamW(params, lr=1e-3, **fused) if kind == "adamw" else \
            torch.optim.SGD(params, lr=1e-3, momentum=0.9 if kind == "sgd_momentum" else 0.0, **fused)
        rows.append((1.0, total, tensors))
        seconds.append(timed(opt.step, device))
    return LinearRate(*map(float, _fit(rows, seconds)))


def host_adamw_rate() -> LinearRate:
    """HostAdamW's whole cost per step: its gradients streamed to the host as backward makes them
    (hooks and copies) and its update, beyond the same backward without it."""

    cpu = torch.device("cpu")
    rows, seconds = [], []
    for total, tensors in [(1 << 16, 4), (1 << 20, 4), (1 << 22, 8), (1 << 20, 64)]:
        weights = [torch.rand(total // tensors) for _ in range(tensors)]

        def backward(params: list) -> Callable[[], None]:
            def run() -> None:
                for p in params:
                    p.grad = None
                sum((p * w).sum() for p, w in zip(params, weights)).backward()
            return run

        plain = [torch.nn.Parameter(torch.rand(total // tensors)) for _ in range(tensors)]
        params = [torch.nn.Parameter(torch.rand(total // tensors)) for _ in range(tensors)]
        opt = HostAdamW([(f"p{i}", p) for i, p in enumerate(params)], lr=1e-3,
                        config=HostOffloadConfig(device_dtype=torch.float32))
        run = backward(params)

        def step() -> None:
            opt.zero_grad()
            run()
            opt.step()

        rows.append((1.0, total, tensors))
        seconds.append(max(timed(step, cpu) - timed(backward(plain), cpu), 0.0))
    return LinearRate(*map(float, _fit(rows, seconds)))


def table_rates(device: torch.device | None = None) -> dict[str, TableRate]:
    """A table group's lookup and update rates per sparse optimizer: host tables and hetero's
    optimizers (``device=None``), or tables moved to ``device`` and torch's sparse optimizers
    (the kinds torch has)."""

    rng = np.random.default_rng(0)
    rows = 1 << 16
    cases = [(4096, rows), (32768, rows), (32768, 512), (4096, 512)]  # ids per table, rows drawn from
    where = device if device is not None else torch.device("cpu")
    budget = 0.15 if device is None else 0.06  # (the device's sparse path is slower on a host: fewer repeats)
    out = {}
    for kind in SparseOptimizerKind if device is None else DEVICE_SPARSE_OPTIMIZERS:
        lookup_x, lookup_y, update_x, update_y = [], [], [], []
        for dim, count in ((1, 1), (8, 1), (32, 1), (8, 8), (16, 24)):  # one group of ``count`` tables
            names = [f"t{i}" for i in range(count)]
            collection = HostEmbeddingCollection([TableConfig(n, rows, dim) for n in names])
            if device is None:
                optimizer = kind.optimizer(dict(collection.tables.items()), kind.optimizer.Config())
            else:
                moved = move_tables_to_device(collection, [f"tables.{n}" for n in names], device)
                optimizer = device_sparse_optimizer(kind, [t.weight for t in moved.values()])
            for n, span in cases[: 4 if count == 1 else 2 if count < 16 else 1]:
                features = {name: torch.from_numpy(rng.integers(0, span, n)).to(where) for name in names}

                def lookup(features: dict = features) -> None:
                    optimizer.zero_grad()
                    sum(y.sum() for y in collection(features).values()).backward()

                def step(features: dict = features) -> None:
                    lookup(features)
                    optimizer.step()

                unique = sum(int(torch.unique(ids).numel()) for ids in features.values())
                warnings.filterwarnings("ignore", "Sparse invariant checks")  # torch's sparse Adagrad, every step
                # (medians of many repeats: the update is a difference of two timings)
                t_lookup = timed(lookup, where, budget_s=budget, max_repeats=200)
                lookup_x.append((1.0, count, n * count, n * count * dim))
                lookup_y.append(t_lookup)
                update_x.append((1.0, count, unique, unique * dim, n * count * dim))
                update_y.append(max(timed(step, where, budget_s=budget, max_repeats=200) - t_lookup, 0.0))
        out[kind.value] = TableRate(*map(float, _fit(lookup_x, lookup_y)), *map(float, _fit(update_x, update_y)))
    return out


def collective_curves(world: int, backend: str = "gloo") -> dict[str, Curve]:
    """All-reduce, all-gather and reduce-scatter seconds by bytes per rank on ``world`` ranks of
    this host (loopback), launched by torchrun (``hetero.planner._collectives``).

    Raises:
        RuntimeError: the measurement failed (its output's end in the message).
    """
    import json
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        out, log = Path(d) / "collectives.json", Path(d) / "log.txt"
        with open(log, "w") as sink:
            run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                    str(world), "-m", "hetero.planner._collectives", str(out), backend],
                                   stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
            # the result counts, not the exit: gloo's teardown has been seen to hang after the
            # ranks wrote it, so a few seconds after the file appears the launch is stopped
            deadline, written = time.monotonic() + float(os.environ.get("HETERO_COLLECTIVES_TIMEOUT", 300)), None
            try:
                while run.poll() is None and time.monotonic() < deadline:
                    if out.is_file() and written is None:
                        written = time.monotonic()
                    if written is not None and time.monotonic() - written > 5:
                        break
                    time.sleep(0.1)
            finally:  # also when interrupted (Ctrl-C): its own session does not get our SIGINT
                if run.poll() is None:  # torchrun stops its ranks on SIGTERM (they run in sessions of their own)
                    os.killpg(run.pid, signal.SIGTERM)
                    try:
                        run.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        os.killpg(run.pid, signal.SIGKILL)
                        run.wait()
        if not out.is_file():
            raise RuntimeError(f"measuring {backend} collectives on {world} ranks failed: {log.read_text()[-2000:]}")
        result = json.loads(out.read_text())
    return {name: Curve.through([tuple(p) for p in pts]) for name, pts in result.items()}
