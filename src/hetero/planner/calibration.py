"""This machine's rates, measured once (seconds) and cached on disk: what the cost model prices.

* **Ops** per :class:`~hetero.planner.capture.OpFamily` and target: matmuls, convolutions (forward
  and backward) and attention by FLOPs, bandwidth-bound ops by bytes, views by count - each a
  :class:`Curve` through timed points of representative shapes (fp32, torch's own kernels, its
  intra-op threads) - and the eager overhead of an op under autograd (the Python call, the
  autograd node, the backward engine), and the hand-off of a host subgraph to the partitioner's
  worker thread after device work (its thread team wakes up). A model's ops are also timed at their exact shapes the
  first time a model with them is planned (:func:`time_shapes`; a convolution's or a batch norm's
  speed depends on its shapes far more than on its FLOPs or bytes), and cached with the rest. Host ops are
  timed on a host worker thread, as host subgraphs run (on a host-only machine - ``host_is_device``,
  the device is the host - the same kernels on one thread: :mod:`hetero.placement.threads`).
* **Host<->device copies** (pinned, each direction) where there is a device.
* **Optimizers** per element and per tensor: torch's AdamW and momentum SGD where the
  parameters live, HostAdamW's host update (a :class:`LinearRate` fitted by least squares).
* **Host tables** per sparse optimizer: seconds per looked-up id and per updated row, per
  element of the row (lookup + backward + update of groups of tables of 2^16 rows, ids drawn from
  all their rows or from 512 of them: :func:`~hetero.planner.timing.table_rates`);
  the same for tables moved to the device, with torch's sparse optimizers.
* **Collectives** per backend and world size (all-reduce, all-gather, reduce-scatter by bytes),
  measured on spawned gloo processes the first time a plan for several ranks asks.

The cache file is keyed by the machine (CPU model, cores, threads, torch version, accelerator);
a calibration from another machine is never used. Reference: Paleo (Qi et al. 2017) and
torch's ``RuntimeEstimator`` roofline mode for per-op rates; the STREAM triad for bandwidth.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import hashlib
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from hetero.planner.calibration_types import Curve, DiskRate, LinearRate, TableRate
from hetero.planner.disk import measure_disk
from hetero.planner.graph import ModelGraph, OpCost, OpFamily
from hetero.planner.timing import (
    copy_curves,
    eager_seconds_per_op,
    handoff_seconds,
    host_adamw_rate,
    op_curves,
    op_scratch,
    optimizer_rate,
    table_rates,
    time_replays,
    worker,
)
from hetero.data.fetch import default_cache_dir
from hetero.planner.timing import collective_curves
from hetero.placement import Target, resolve_device
from hetero.parallel.comm import Collective
from hetero.planner.space import OptimizerKind

VERSION = 16  # bump when what is measured changes: older cache files are measured again

log = logging.getLogger("hetero")


# The cache file's keys (its JSON), made here alone: everything else asks by type
# (Calibration.optimizer_rate, .host_adamw, .collective_curves).
_ON_HOST = "_host"  # torch's optimizer stepping on the host's cores
_HOST_ADAMW = "host_adamw"
_MEASURED = {Collective.ALL_REDUCE: "all_reduce", Collective.ALL_GATHER: "all_gather",
             Collective.REDUCE_SCATTER: "reduce_scatter"}  # what hetero.planner._collectives measures


def _collective_key(world: int, backend: str = "gloo") -> str:
    return f"{backend}:{world}"


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
        optimizers: ``"adamw"``, ``"sgd"``, ``"sgd_momentum"`` (torch's, on the device), the same
            with ``"_host"`` (torch's on the host), ``"host_adamw"`` -> :class:`LinearRate`.
        tables: sparse optimizer kind value -> :class:`TableRate` of host tables.
        op_overhead_s: an op's eager overhead beyond its kernel (Python call, autograd).
        handoff_s: handing a host subgraph to the partitioner's worker thread after device work
            (its thread team wakes up) and waiting: a boundary's.
        shapes: target -> op signature -> seconds at its exact shapes (NaN: not replayable).
        collectives: ``"<backend>:<world>"`` -> collective name -> :class:`Curve` by bytes.
        seconds: how long the measurement took.
        device_tables: sparse optimizer kind value -> :class:`TableRate` of tables moved to
            the device (torch's sparse optimizers: LazyAdam, Adagrad, SGD).
        disks: a disk's key (:func:`disk_key`) -> its :class:`DiskRate` (the SSD tier's; measured
            the first time a plan may put tables on it, :func:`disk`).
        op_scratch: (bytes reduced, device bytes of scratch) of a sum over a gradient's batch
            dimension, by size (:func:`hetero.planner.timing.op_scratch`; none without an
            accelerator): read through :meth:`scratch_bytes`.
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
    device_tables: dict[str, TableRate] = dataclasses.field(default_factory=dict)
    disks: dict[str, DiskRate] = dataclasses.field(default_factory=dict)
    op_scratch: tuple[tuple[int, int], ...] = ()

    def optimizer_rate(self, kind: OptimizerKind, on: Target = Target.DEVICE) -> LinearRate:
        """torch's dense optimizer ``kind`` stepping on ``on``'s cores (the device's or the host's)."""
        return self.optimizers[kind.calibrated if on is Target.DEVICE else f"{kind.calibrated}{_ON_HOST}"]

    def scratch_bytes(self, nbytes: int) -> int:
        """Device scratch bytes of summing an ``nbytes`` gradient over its batch dimension: what
        was measured for the smallest measured input at least as large (in proportion beyond the
        largest); 0 where nothing was measured (no accelerator)."""
        for reduced, scratch in self.op_scratch:
            if nbytes <= reduced:
                return scratch
        if not self.op_scratch:
            return 0
        reduced, scratch = self.op_scratch[-1]
        return int(scratch * nbytes / reduced)

    @property
    def host_adamw(self) -> LinearRate:
        """HostAdamW's update on the host (``hetero.optim.HostAdamW``)."""
        return self.optimizers[_HOST_ADAMW]

    def collective_curves(self, world: int) -> dict[Collective, Curve] | None:
        """The gloo collectives over ``world`` ranks of this host, by kind (``None``: not
        measured; see :func:`collectives`)."""
        stored = self.collectives.get(_collective_key(world))
        return None if stored is None else {kind: stored[name] for kind, name in _MEASURED.items()}

    def op_seconds(self, target: str, op: OpCost, scale: float = 1.0) -> float:
        """One op's predicted seconds on ``target`` with its work scaled by ``scale`` (1: as
        captured): its exact-shape time if measured (scaled along its family's curve), else the
        curve's; plus the eager overhead (none for a view). Host curves are timed on a host worker
        (:func:`hetero.placement.threads.host_worker`); on a host-only machine, where that is the
        device's kernels on one thread, a host op's exact time is the device's scaled by the ratio
        of the two curves at its work (one timing per shape)."""
        shapes_of = "device" if self.host_is_device else target
        curve = self.ops[target][op.family.value]
        if op.family is OpFamily.VIEW:
            return curve.points[0][1]
        work = (op.nbytes if op.family is OpFamily.MEMORY else max(op.flops, 1.0)) * scale
        t = curve.seconds(work)
        exact = self.shapes.get(shapes_of, {}).get(op.signature) if op.signature else None
        if exact is not None and not math.isnan(exact):
            timed_on = self.ops[shapes_of][op.family.value]
            # a share of the work takes no less than that share of the time, no more than all of it
            t = exact * min(1.0, max(scale, timed_on.seconds(work) / timed_on.seconds(work / scale)))
            t *= curve.seconds(work) / timed_on.seconds(work)  # (1 where the shape was timed on the target)
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
            doc.get("seconds", 0.0), {k: TableRate(**v) for k, v in doc.get("device_tables", {}).items()},
            {k: DiskRate(**v) for k, v in doc.get("disks", {}).items()},
            tuple((int(b), int(n)) for b, n in doc.get("op_scratch", ())))


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


def collectives(calibration: Calibration, world: int, cache_dir: Path | None = None, backend: str = "gloo") -> None:
    """Add the collectives of ``world`` ranks (``backend``) to ``calibration`` if missing: measured
    on spawned processes of this host (seconds), then cached with the rest."""
    from filelock import FileLock


    key = _collective_key(world, backend)
    if world < 2 or key in calibration.collectives:
        return
    log.info("hetero: measuring %s collectives on %d ranks of this host (once; cached)", backend, world)
    calibration.collectives[key] = collective_curves(world, backend)
    path = cache_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        _write(path, calibration)


def disk_key(directory: Path) -> str:
    """The key of the disk holding ``directory`` (or its nearest existing parent): its device number."""
    path = Path(directory).resolve()
    while not path.exists():
        path = path.parent
    return f"dev{os.stat(path).st_dev}"


def disk(calibration: Calibration, directory: Path, cache_dir: Path | None = None) -> DiskRate:
    """The :class:`DiskRate` of the disk holding ``directory``: measured there the first time
    (:func:`hetero.planner.disk.measure_disk`, a second or so), then cached with the rest."""
    from filelock import FileLock

    key = disk_key(directory)
    if key not in calibration.disks:
        log.info("hetero: measuring the disk of %s for the SSD tier (once; cached)", directory)
        calibration.disks[key] = measure_disk(Path(directory))
        path = cache_path(cache_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            _write(path, calibration)
    return calibration.disks[key]


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


def measure() -> Calibration:
    """Measure every rate (see the module docstring): 53 s on the 2-core CI host (2026-11-29), of which
    the host tables' rates took 29 s and the tables moved to the device 7 s."""

    start = time.perf_counter()
    key, text = machine_key()
    device = resolve_device(Target.DEVICE)
    host_is_device = device.type == "cpu"
    # the first calibration takes minutes on a small host: say what it measures as it goes
    steps = iter(("the device's op rates", "the host's op rates", "host <-> device copies", "the dense optimizers",
                  "the host tables' lookups and updates"))
    say = lambda: log.info("hetero: calibrating this machine (once; cached): %s (%.0f s so far)",  # noqa: E731
                           next(steps), time.perf_counter() - start)
    say()
    ops = {"device": op_curves(device)}
    say()
    with worker() as on_worker:  # host subgraphs run on the partitioner's worker, with its thread team
        ops["host"] = on_worker(functools.partial(op_curves, torch.device("cpu")))()[0]
    say()
    h2d = d2h = None
    if not host_is_device:
        h2d, d2h = copy_curves(device)
    say()
    kinds = ("adamw", "sgd", "sgd_momentum")
    optimizers = {k: optimizer_rate(device, k) for k in kinds}
    optimizers.update({f"{k}{_ON_HOST}": optimizers[k] if host_is_device else optimizer_rate(torch.device("cpu"), k)
                       for k in kinds})
    optimizers[_HOST_ADAMW] = host_adamw_rate()
    say()
    tables = table_rates()
    device_tables = table_rates(device)
    log.info("hetero: calibrated in %.0f s", time.perf_counter() - start)
    small = ops["device"]["memory"].points[0][1]  # a direct call's cost, in the curves already
    overhead = max(0.0, eager_seconds_per_op(device) - small)
    return Calibration(key, text, "cpu" if host_is_device else torch.cuda.get_device_name(device), host_is_device, ops,
                       h2d, d2h, optimizers, tables, overhead, handoff_seconds(), {}, {}, time.perf_counter() - start,
                       device_tables, {}, op_scratch(device))


def time_shapes(calibration: Calibration, graph: ModelGraph, targets: tuple[str, ...] = ("device",),
                cache_dir: Path | None = None) -> int:
    """Time ``graph``'s ops at their exact shapes on ``targets`` where not yet timed (random
    values, integer tensors zero; a few repeats each), add them to ``calibration`` and to the
    cache file; returns how many were timed. An op that cannot be replayed alone keeps its
    family's curve (recorded as such, not retried)."""
    from filelock import FileLock

    todo = []
    for target in targets:
        if target == "host" and calibration.host_is_device:
            continue  # the device's, scaled (see Calibration.op_seconds)
        known = calibration.shapes.setdefault(target, {})
        todo += [(target, sig) for sig in graph.replays if sig not in known]
    if not todo:
        return 0
    time_replays(calibration, graph, [x for x in todo if x[0] != "host"])
    if any(x[0] == "host" for x in todo):
        with worker() as on_worker:  # (as the host curves: on the partitioner's kind of worker)
            on_worker(functools.partial(time_replays, calibration, graph, [x for x in todo if x[0] == "host"]))()
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


