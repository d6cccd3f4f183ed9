"""This machine's rates, measured once (seconds) and cached on disk: what the cost model prices.

* **Ops** per :class:`~hetero.planner.capture.OpFamily` and target: matmuls, convolutions (forward
  and backward) and attention by FLOPs, bandwidth-bound ops by bytes, views by count - each a
  :class:`Curve` through timed points of representative shapes (fp32, torch's own kernels, its
  intra-op threads) - and the eager overhead of an op under autograd (the Python call, the
  autograd node, the backward engine). Host ops are timed as the partitioner runs them, on a
  worker thread the caller waits on (on a host-only machine that thread's own OpenMP team
  shares the cores with the caller's: measured 13-27% slower per op on 2 cores). A model's ops are also timed at their exact shapes the
  first time a model with them is planned (:func:`time_shapes`; a convolution's or a batch norm's
  speed depends on its shapes far more than on its FLOPs or bytes), and cached with the rest. On a host-only machine the device is the host: one measurement serves both
  targets and the calibration says so (``host_is_device``); a copy between them costs nothing
  (hetero makes none there).
* **Host<->device copies** (pinned, each direction) where there is a device.
* **Optimizers** per element and per tensor: torch's AdamW and momentum SGD where the
  parameters live, HostAdamW's host update (a :class:`LinearRate` fitted by least squares).
* **Host tables** per sparse optimizer: seconds per looked-up id and per updated row, per
  element of the row (lookup + backward + update of a table of 2^18 rows, uniform and skewed ids).
* **Collectives** per backend and world size (all-reduce, all-gather, reduce-scatter by bytes),
  measured on spawned gloo processes the first time a plan for several ranks asks.

The cache file is keyed by the machine (CPU model, cores, threads, torch version, accelerator);
a calibration from another machine is never used. Reference: Paleo (Qi et al. 2017) and
torch's ``RuntimeEstimator`` roofline mode for per-op rates; the STREAM triad for bandwidth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetero.planner.capture import ModelGraph, OpCost, OpFamily

VERSION = 1  # bump when what is measured changes: older cache files are measured again


@dataclasses.dataclass(frozen=True)
class Curve:
    """Seconds as a function of an amount of work (FLOPs, bytes, elements): measured points,
    piecewise linear in log-log space between them, proportional to the work beyond the largest
    and the smallest point's time below it (a fixed cost dominates small work)."""

    points: tuple[tuple[float, float], ...]

    def seconds(self, work: float) -> float:
        pts = self.points
        if work <= pts[0][0]:
            return pts[0][1]
        if work >= pts[-1][0]:
            return pts[-1][1] * work / pts[-1][0]
        lw = math.log(work)
        for (w0, s0), (w1, s1) in zip(pts, pts[1:]):
            if work <= w1:
                f = (lw - math.log(w0)) / (math.log(w1) - math.log(w0))
                return math.exp(math.log(s0) + f * (math.log(s1) - math.log(s0)))
        return pts[-1][1]  # pragma: no cover - the loop always returns

    @staticmethod
    def through(points: list[tuple[float, float]]) -> "Curve":
        """A curve through ``points`` (work, seconds); points of equal work are averaged."""
        merged: dict[float, list[float]] = {}
        for w, s in points:
            merged.setdefault(float(w), []).append(max(float(s), 1e-9))
        return Curve(tuple((w, statistics.fmean(v)) for w, v in sorted(merged.items())))


@dataclasses.dataclass(frozen=True)
class LinearRate:
    """Seconds = ``fixed + per_element * elements + per_tensor * tensors`` (an optimizer step)."""

    fixed: float
    per_element: float
    per_tensor: float

    def seconds(self, elements: float, tensors: float) -> float:
        return max(0.0, self.fixed + self.per_element * elements + self.per_tensor * tensors) if elements else 0.0


@dataclasses.dataclass(frozen=True)
class TableRate:
    """A host table's step with one sparse optimizer: seconds = ``fixed + per_id_element *
    ids * dim + per_row_element * unique_rows * dim`` (lookup, backward and update)."""

    fixed: float
    per_id_element: float
    per_row_element: float

    def seconds(self, ids: float, rows: float, dim: int) -> float:
        return self.fixed + (self.per_id_element * ids + self.per_row_element * rows) * dim


@dataclasses.dataclass
class Calibration:
    """This machine's measured rates (see the module docstring).

    Attributes:
        key: the machine's cache key; ``machine``: the same in words.
        device: what runs the device part (``"cpu"``, or the accelerator's name).
        host_is_device: no accelerator: the device part runs on the host's cores.
        ops: target (``"host"``/``"device"``) -> op family value -> :class:`Curve` (FLOPs,
            bytes, or one op for views).
        h2d, d2h: copy seconds by bytes (``None`` where the host is the device: no copy).
        optimizers: ``"adamw"``, ``"sgd"`` (torch's, on the device), ``"adamw_host"``,
            ``"sgd_host"`` (torch's on the host), ``"host_adamw"`` -> :class:`LinearRate`.
        tables: sparse optimizer kind value -> :class:`TableRate`.
        op_overhead_s: an op's eager overhead beyond its kernel (Python call, autograd).
        handoff_s: handing a host subgraph to the partitioner's worker thread and waiting.
        shapes: target -> op signature -> seconds at its exact shapes (NaN: not replayable).
        collectives: ``"<backend>:<world>"`` -> collective name -> :class:`Curve` by bytes.
        seconds: how long the measurement took.
    """

    key: str
    machine: str
    device: str
    host_is_device: bool
    ops: dict[str, dict[str, Curve]]
    h2d: Curve | None
    d2h: Curve | None
    optimizers: dict[str, LinearRate]
    tables: dict[str, TableRate]
    op_overhead_s: float = 0.0
    handoff_s: float = 0.0
    shapes: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    collectives: dict[str, dict[str, Curve]] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def op_seconds(self, target: str, op: OpCost, scale: float = 1.0) -> float:
        """One op's predicted seconds on ``target`` with its work scaled by ``scale`` (a
        micro-batch's share): its exact-shape time if measured (scaled along its family's
        curve), else the curve's; plus the eager overhead (none for a view)."""
        curve = self.ops[target][op.family.value]
        if op.family is OpFamily.VIEW:
            return curve.points[0][1]
        work = op.nbytes if op.family is OpFamily.MEMORY else max(op.flops, 1.0)
        exact = self.shapes.get(target, {}).get(op.signature) if op.signature else None
        t = curve.seconds(work * scale)
        if exact is not None and not math.isnan(exact):
            t = exact if scale == 1.0 else exact * t / curve.seconds(work)
        return t + self.op_overhead_s

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, **dataclasses.asdict(self)}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> "Calibration":
        def curve(c: dict | None) -> Curve | None:
            return None if c is None else Curve(tuple(tuple(p) for p in c["points"]))

        return Calibration(
            doc["key"], doc["machine"], doc["device"], doc["host_is_device"],
            {t: {f: curve(c) for f, c in fams.items()} for t, fams in doc["ops"].items()},
            curve(doc["h2d"]), curve(doc["d2h"]),
            {k: LinearRate(**v) for k, v in doc["optimizers"].items()},
            {k: TableRate(**v) for k, v in doc["tables"].items()}, doc["op_overhead_s"], doc["handoff_s"],
            doc["shapes"],
            {k: {c: curve(v) for c, v in coll.items()} for k, coll in doc.get("collectives", {}).items()},
            doc.get("seconds", 0.0))


def machine_key() -> tuple[str, str]:
    """(cache key, description) of this machine: CPU model, cores, threads, torch, accelerator."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    accel = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    text = f"{cpu}; {os.cpu_count()} cores; {torch.get_num_threads()} threads; torch {torch.__version__}; " \
           f"accelerator {accel}"
    return hashlib.sha256(f"{VERSION}|{text}".encode()).hexdigest()[:16], text


def cache_path(cache_dir: Path | None = None) -> Path:
    """Where this machine's calibration is cached."""
    from hetero.data.fetch import default_cache_dir

    return Path(cache_dir or default_cache_dir()) / "calibration" / f"{machine_key()[0]}.json"


def calibrate(cache_dir: Path | None = None, refresh: bool = False) -> Calibration:
    """This machine's :class:`Calibration`: from the cache, else measured (seconds) and cached
    (written atomically; concurrent processes wait for the one measuring).

    Raises:
        OSError: the cache directory cannot be written.
    """
    from filelock import FileLock

    path = cache_path(cache_dir)
    if path.is_file() and not refresh:
        cached = _read(path)
        if cached is not None:
            return cached
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.is_file() and not refresh:
            cached = _read(path)
            if cached is not None:
                return cached
        result = measure()
        _write(path, result)
        return result


def _read(path: Path) -> Calibration | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return Calibration.from_json(doc) if doc.get("version") == VERSION and doc.get("key") == machine_key()[0] else None


def _write(path: Path, result: Calibration) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    os.replace(tmp, path)


def _timed(fn: Callable[[], object], device: torch.device, budget_s: float = 0.05, max_repeats: int = 50) -> float:
    """Median seconds of ``fn()`` over repeats filling about ``budget_s`` (after one warm-up);
    on CUDA each repeat is bracketed by synchronisations (sync points: the kernels' time)."""
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
    return statistics.median(times)


timed = _timed


def measure() -> Calibration:
    """Measure every rate (see the module docstring); about 10 s on a 2-core host."""
    from hetero.placement import Target, resolve_device

    start = time.perf_counter()
    key, text = machine_key()
    device = resolve_device(Target.DEVICE)
    host_is_device = device.type == "cpu"
    handoff = _handoff_seconds()
    ops = {"host": _op_curves(torch.device("cpu"), True, handoff), "device": _op_curves(device)}
    h2d = d2h = None
    if not host_is_device:
        h2d, d2h = _copy_curves(device)
    optimizers = {"adamw": _optimizer_rate(device, "adamw"), "sgd": _optimizer_rate(device, "sgd")}
    optimizers["adamw_host"] = optimizers["adamw"] if host_is_device else _optimizer_rate(torch.device("cpu"), "adamw")
    optimizers["sgd_host"] = optimizers["sgd"] if host_is_device else _optimizer_rate(torch.device("cpu"), "sgd")
    optimizers["host_adamw"] = _host_adamw_rate()
    tables = _table_rates()
    small = ops["device"]["memory"].points[0][1]  # a direct call's cost, in the curves already
    overhead = max(0.0, _eager_seconds_per_op(device) - small)
    return Calibration(key, text, "cpu" if host_is_device else torch.cuda.get_device_name(device), host_is_device, ops,
                       h2d, d2h, optimizers, tables, overhead, handoff, {}, {}, time.perf_counter() - start)


def time_shapes(calibration: Calibration, graph: ModelGraph, targets: tuple[str, ...] = ("device",),
                cache_dir: Path | None = None) -> int:
    """Time ``graph``'s ops at their exact shapes on ``targets`` where not yet timed (random
    values, integer tensors zero; a few repeats each), add them to ``calibration`` and to the
    cache file; returns how many were timed. An op that cannot be replayed alone keeps its
    family's curve (recorded as such, not retried)."""
    from filelock import FileLock

    todo = []
    for target in targets:
        known = calibration.shapes.setdefault(target, {})
        todo += [(target, sig) for sig in graph.replays if sig not in known]
    if not todo:
        return 0
    with _worker() as wrap:
        _time_replays(calibration, graph, todo, wrap, calibration.handoff_s)
    path = cache_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        on_disk = _read(path) if path.is_file() else None
        if on_disk is not None and on_disk.key == calibration.key:
            for target, times in on_disk.shapes.items():  # another process's shapes, kept
                calibration.shapes.setdefault(target, {}).update({k: v for k, v in times.items()
                                                                  if k not in calibration.shapes[target]})
        _write(path, calibration)
    return len(todo)


def _time_replays(calibration: Calibration, graph: ModelGraph, todo: list[tuple[str, str]], wrap: Callable,
                  handoff: float) -> None:
    from hetero.placement import Target, resolve_device

    for target, sig in todo:
        device = resolve_device(Target.HOST if target == "host" else Target.DEVICE)
        replay = graph.replays[sig]
        args, kwargs = _materialise((replay.args, replay.kwargs), device)

        def run(replay: Any = replay, args: Any = args, kwargs: Any = kwargs) -> object:  # noqa: ANN401
            return replay.op(*args, **kwargs)

        try:  # host ops as the partitioner runs them: on a worker thread (the hand-off is the boundary's)
            seconds = timed(run, device, budget_s=0.01, max_repeats=10) if target != "host" else \
                max(timed(wrap(run), device, budget_s=0.01, max_repeats=10) - handoff, 1e-7)
        except Exception:  # noqa: BLE001 - an op that needs real values (an index, a shape): the curve serves
            seconds = float("nan")
        calibration.shapes[target][sig] = seconds


def _materialise(tree: Any, device: torch.device) -> Any:  # noqa: ANN401 - a pytree of replay arguments
    """Replay arguments with random tensors of their specs on ``device``."""
    from torch.utils import _pytree as pytree

    from hetero.planner.capture import TensorSpec

    def make(x: Any) -> Any:  # noqa: ANN401
        if not isinstance(x, TensorSpec):
            return x
        size = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride)) if all(x.shape) else 0
        base = torch.rand(max(size, 1), device=device).to(x.dtype) if x.dtype.is_floating_point else \
            torch.zeros(max(size, 1), dtype=x.dtype, device=device)
        return base.as_strided(x.shape, x.stride)

    return pytree.tree_map(make, tree)


def _eager_seconds_per_op(device: torch.device) -> float:
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

    from hetero.planner.capture import op_flops

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
def _worker() -> Iterator[Callable[[Callable[[], object]], Callable[[], object]]]:
    """A function making ``fn`` run on one worker thread the caller waits on (how the
    partitioner runs host subgraphs); the thread ends with the block."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetero-calibration") as pool:
        yield lambda fn: (lambda: pool.submit(fn).result())


def _handoff_seconds() -> float:
    """Seconds of handing a task to a worker thread and waiting for it (per host subgraph run)."""
    with _worker() as wrap:
        return _timed(wrap(lambda: None), torch.device("cpu"), budget_s=0.05)


def _op_curves(device: torch.device, on_worker: bool = False, handoff: float = 0.0) -> dict[str, Curve]:
    if not on_worker:
        return _op_curves_with(device, lambda fn: fn, 0.0)
    with _worker() as wrap:
        return _op_curves_with(device, wrap, handoff)


def _op_curves_with(device: torch.device, wrap: Callable, handoff: float) -> dict[str, Curve]:
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(0)

    def timed(fn: Callable[[], object], device: torch.device, **kwargs: Any) -> float:  # noqa: ANN401
        return max(_timed(wrap(fn), device, **kwargs) - handoff, 1e-7)  # the hand-off is the boundary's

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
    return {k: Curve.through(v) for k, v in out.items()}


def _copy_curves(device: torch.device) -> tuple[Curve, Curve]:
    up, down = [], []
    for n in [1 << 12, 1 << 16, 1 << 20, 1 << 24]:
        host = torch.empty(n, dtype=torch.uint8).pin_memory()
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        up.append((n, timed(lambda: dev.copy_(host, non_blocking=True), device)))
        down.append((n, timed(lambda: host.copy_(dev, non_blocking=True), device)))
    return Curve.through(up), Curve.through(down)


def _fit(rows: list[tuple[float, ...]], seconds: list[float]) -> np.ndarray:
    """Least-squares coefficients (non-negative where the data allow) of ``seconds ~ rows``."""
    coef, *_ = np.linalg.lstsq(np.array(rows, dtype=np.float64), np.array(seconds), rcond=None)
    return np.maximum(coef, 0.0)


def _optimizer_rate(device: torch.device, kind: str) -> LinearRate:
    rows, seconds = [], []
    for total, tensors in [(1 << 16, 4), (1 << 20, 4), (1 << 22, 8), (1 << 20, 64), (1 << 16, 64)]:
        params = [torch.nn.Parameter(torch.rand(total // tensors, device=device)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.rand_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3) if kind == "adamw" else torch.optim.SGD(params, lr=1e-3, momentum=0.9)
        rows.append((1.0, total, tensors))
        seconds.append(timed(opt.step, device))
    return LinearRate(*map(float, _fit(rows, seconds)))


def _host_adamw_rate() -> LinearRate:
    from hetero.optim import HostAdamW, HostOffloadConfig

    rows, seconds = [], []
    for total, tensors in [(1 << 16, 4), (1 << 20, 4), (1 << 22, 8), (1 << 20, 64)]:
        params = [torch.nn.Parameter(torch.rand(total // tensors)) for _ in range(tensors)]
        opt = HostAdamW([(f"p{i}", p) for i, p in enumerate(params)], lr=1e-3,
                        config=HostOffloadConfig(device_dtype=torch.float32))
        for p in params:
            opt.grad_buffer(p).copy_(torch.rand(p.numel()))
        rows.append((1.0, total, tensors))
        seconds.append(timed(opt.update_from_host_gradients, torch.device("cpu")))
    return LinearRate(*map(float, _fit(rows, seconds)))


def _table_rates() -> dict[str, TableRate]:
    from hetero.embedding import HostEmbeddingCollection, TableConfig
    from hetero.optim import SparseOptimizerKind

    rng = np.random.default_rng(0)
    rows = 1 << 18
    cases = [(4096, rows), (32768, rows), (32768, 512)]  # (ids, distinct rows drawn from)
    out = {}
    for kind in SparseOptimizerKind:
        xs, ys = [], []
        for dim in (8, 32):
            collection = HostEmbeddingCollection([TableConfig("t", rows, dim)])
            optimizer = kind.optimizer(dict(collection.tables.items()), kind.optimizer.Config())
            for n, span in cases:
                ids = torch.from_numpy(rng.integers(0, span, n))

                def step(ids: torch.Tensor = ids) -> None:
                    optimizer.zero_grad()
                    collection({"t": ids})["t"].sum().backward()
                    optimizer.step()

                xs.append((1.0, n * dim, int(torch.unique(ids).numel()) * dim))
                ys.append(timed(step, torch.device("cpu")))
        out[kind.value] = TableRate(*map(float, _fit(xs, ys)))
    return out


def collective_curves(world: int, backend: str = "gloo") -> dict[str, Curve]:
    """All-reduce, all-gather and reduce-scatter seconds by bytes per rank on ``world`` spawned
    ``backend`` processes of this host (loopback)."""
    import torch.multiprocessing as mp

    from hetero.planner._collectives import measure_rank, free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(measure_rank, args=(world, free_port(), backend, queue), nprocs=world, join=True,
                       start_method="spawn")
    result = queue.get()
    return {name: Curve.through([tuple(p) for p in pts]) for name, pts in result.items()}
