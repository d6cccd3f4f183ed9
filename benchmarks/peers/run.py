"""hetero's embedding step against its peers, same run: FBGEMM's table-batched embedding
(fbgemm-gpu-cpu), TorchRec's fused embedding bag collection and torch's SparseAdam (issue #39);
with ``--model dlrm``, the DLRM training step against TorchRec's DLRM and its own dense part.

Each measurement is a process of its own (``systems.py``), hetero's and torch's in hetero's
environment, FBGEMM's and TorchRec's in the peers' (``requirements.txt``: not a dependency of
hetero), interleaved in rounds (each round starts one measurement later, so no system always
runs first); medians over the rounds and their ratios go to ``benchmarks/results/peers_<isa>_cpu.json``
(``avx512``, ``avx2``) with the CPU's model, and the last line printed. Set up the peers' environment once::

    python3 -m venv /tmp/peers && /tmp/peers/bin/pip install -r benchmarks/peers/requirements.txt
    /tmp/peers/bin/pip install --no-deps torchrec==1.8.0
    .venv/bin/python benchmarks/peers/run.py --peers-python /tmp/peers/bin/python
    .venv/bin/python benchmarks/peers/run.py --peers-python /tmp/peers/bin/python --model dlrm --dist zipf

Targets (#39): row-wise Adagrad and SGD >= 1.5x FBGEMM, Adagrad >= 3x, LazyAdam >= 6x torch's
SparseAdam; per-id lookups no slower than pooled ones (hetero's per-id against its pooled bags of
one id: measured in one process, alternating step by step, as processes on a shared machine
differ by more than the gap).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _common import emit  # noqa: E402

# (system, optimizer, pooled): pooled bags of one id, or per-id lookups
MEASUREMENTS = [("hetero", "rowwise_adagrad", True), ("fbgemm", "rowwise_adagrad", True),
                ("torchrec", "rowwise_adagrad", True), ("hetero", "sgd", True), ("fbgemm", "sgd", True),
                ("hetero", "adagrad", True), ("fbgemm", "adagrad", True), ("hetero", "lazy_adam", True),
                ("torch", "lazy_adam", True), ("hetero", "rowwise_adagrad", False), ("fbgemm", "rowwise_adagrad", False)]
# (name, numerator, denominator, target): ratios of the medians
RATIOS = [("rowwise_adagrad_vs_fbgemm", ("hetero", "rowwise_adagrad", True), ("fbgemm", "rowwise_adagrad", True), 1.5),
          ("rowwise_adagrad_vs_torchrec", ("hetero", "rowwise_adagrad", True), ("torchrec", "rowwise_adagrad", True), None),
          ("sgd_vs_fbgemm", ("hetero", "sgd", True), ("fbgemm", "sgd", True), 1.5),
          ("adagrad_vs_fbgemm", ("hetero", "adagrad", True), ("fbgemm", "adagrad", True), 3.0),
          ("lazy_adam_vs_torch_sparse_adam", ("hetero", "lazy_adam", True), ("torch", "lazy_adam", True), 6.0),
          ("per_id_vs_fbgemm_per_id", ("hetero", "rowwise_adagrad", False), ("fbgemm", "rowwise_adagrad", False), None),
          ("per_id_vs_fbgemm_pooled", ("hetero", "rowwise_adagrad", False), ("fbgemm", "rowwise_adagrad", True), None)]


def cpu() -> dict:
    """The CPU's model and widest vector ISA (from ``/proc/cpuinfo``), what FBGEMM's kernels are built for."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    return {"model": model, "isa": isa, "cores": os.cpu_count()}


def measure(python: str, system: str, optimizer: str, pooled: bool, args: argparse.Namespace, *extra: str) -> dict:
    """The JSON line of one measurement in a process of its own (``samples_per_s``, ...).

    Raises:
        RuntimeError: the process failed (its stderr's end)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    argv = [python, str(HERE / "systems.py"), "--system", system, "--optimizer", optimizer, "--rows", str(args.rows),
            "--dist", args.dist, "--steps", str(args.steps), "--warmup", str(args.warmup), *(["--pooled"] if pooled else []),
            *extra]
    run = subprocess.run(argv, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"{system} {optimizer}: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def dlrm(args: argparse.Namespace) -> None:
    """``--model dlrm``: hetero's DLRM step against TorchRec's and against its own dense part, each a
    process of its own, interleaved in rounds; medians and ratios to ``peers_dlrm_<dist>_cpu.json``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    systems = ["hetero", "torchrec", "dense"]
    runs: dict[str, list[float]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for s in systems[r % len(systems):] + systems[: r % len(systems)]:
            argv = [args.peers_python if s == "torchrec" else args.hetero_python, str(HERE / "dlrm_systems.py"),
                    "--system", s, "--rows", str(args.rows), "--dist", args.dist, "--steps", str(args.steps),
                    "--warmup", str(args.warmup)]
            run = subprocess.run(argv, capture_output=True, text=True, env=env)
            if run.returncode != 0:
                raise RuntimeError(f"dlrm {s}: {run.stderr[-2000:]}")
            runs[s].append(json.loads(run.stdout.strip().splitlines()[-1])["samples_per_s"])
            print(f"round {r}: dlrm {s:8s} {runs[s][-1]:10.0f} samples/s", file=sys.stderr)
    medians = {s: statistics.median(v) for s, v in runs.items()}
    emit(f"peers_dlrm_{args.dist}", {
        "workload": {"model": "dlrm", "tables": 26, "rows_per_table": args.rows, "dim": 16, "batch": 4096,
                     "bottom": [512, 256, 64, 16], "top": [512, 256, 1], "dist": args.dist, "steps": args.steps,
                     "rounds": args.rounds},
        "cpu": cpu(), "samples_per_s": medians, "rounds_samples_per_s": runs,
        "ratios": {"hetero_vs_torchrec": medians["hetero"] / medians["torchrec"],
                   "hetero_vs_dense_part": medians["hetero"] / medians["dense"],
                   "torchrec_vs_dense_part": medians["torchrec"] / medians["dense"]}})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["embedding", "dlrm"], default="embedding",
                   help="the embedding step alone (systems.py), or the DLRM training step (dlrm_systems.py)")
    p.add_argument("--peers-python", required=True, help="the interpreter of the peers' environment (requirements.txt)")
    p.add_argument("--hetero-python", default=sys.executable, help="hetero's interpreter (default: this one)")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table (26 tables x 16 fp32)")
    p.add_argument("--dist", choices=["uniform", "zipf"], default="uniform")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    if args.model == "dlrm":
        return dlrm(args)
    runs: dict[tuple, list[float]] = {m: [] for m in MEASUREMENTS}
    both: list[float] = []
    for r in range(args.rounds):
        for m in MEASUREMENTS[r % len(MEASUREMENTS):] + MEASUREMENTS[: r % len(MEASUREMENTS)]:
            python = args.peers_python if m[0] in ("fbgemm", "torchrec") else args.hetero_python
            runs[m].append(measure(python, *m, args)["samples_per_s"])
            print(f"round {r}: {m[0]:8s} {m[1]:16s} {'pooled' if m[2] else 'per-id':7s} {runs[m][-1]:10.0f} samples/s",
                  file=sys.stderr)
        # per-id against pooled bags of one: in one process, alternating step by step (the gap between
        # processes on a shared VM is larger than the one measured)
        both.append(measure(args.hetero_python, "hetero", "rowwise_adagrad", False, args, "--both")["per_id_over_pooled"])
    medians = {f"{s}/{o}/{'pooled' if pooled else 'per_id'}": statistics.median(v) for (s, o, pooled), v in runs.items()}
    ratios = {}
    for name, a, b, target in RATIOS:
        value = statistics.median(runs[a]) / statistics.median(runs[b])
        ratios[name] = {"ratio": value, "target": target, "met": None if target is None else value >= target}
    value = statistics.median(both)
    ratios["per_id_vs_pooled"] = {"ratio": value, "target": 1.0, "met": value >= 0.95, "same_process": True,
                                  "rounds": both}  # (met: within 5%, the noise of one process)
    machine = cpu()
    emit(f"peers_{machine['isa']}", {"workload": {"tables": 26, "rows_per_table": args.rows, "dim": 16, "batch": 4096, "ids_per_table": 1,
                                "dist": args.dist, "steps": args.steps, "rounds": args.rounds},
                   "cpu": machine, "samples_per_s": medians, "ratios": ratios,
                   "rounds_samples_per_s": {f"{s}/{o}/{'pooled' if pooled else 'per_id'}": v for (s, o, pooled), v in runs.items()}})


if __name__ == "__main__":
    main()
