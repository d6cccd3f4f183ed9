"""hetero's embedding step against its peers, same run: FBGEMM's table-batched embedding
(fbgemm-gpu-cpu), TorchRec's fused embedding bag collection and torch's SparseAdam (issue #39);
with ``--model dlrm``, the DLRM training step against TorchRec's DLRM and its own dense part.

Each system is a process of its own (``systems.py``), hetero's and torch's in hetero's
environment, FBGEMM's and TorchRec's in the peers' (``requirements.txt``: not a dependency of
hetero). The two sides of a ratio run at once but take turns: each process sets up, then times
``--block`` steps whenever the coordinator asks (``--serve``), alternating for ``--blocks`` turns;
a round's ratio is the median over turns of the two rates of the same turn, and the ratio the
median over ``--rounds`` rounds, each with fresh processes. A shared VM's speed
moves by half and more between processes a minute apart (2026-11-27: hetero's row-wise Adagrad
step ran at 256k-628k samples/s in five processes of one run, FBGEMM's at 275k-379k); turns a
fraction of a second apart see the same machine. The rates, ratios, targets and the CPU's model
vector ISA and vendor go to ``benchmarks/results/peers_<isa>_<vendor>_cpu.json`` (``avx512_intel``,
``avx2_amd``, ...: :func:`_common.cpu`'s tag), and the last line printed. Set up the peers' environment once::

    python3 -m venv /tmp/peers && /tmp/peers/bin/pip install -r benchmarks/peers/requirements.txt
    /tmp/peers/bin/pip install --no-deps torchrec==1.8.0
    .venv/bin/python benchmarks/peers/run.py --peers-python /tmp/peers/bin/python
    .venv/bin/python benchmarks/peers/run.py --peers-python /tmp/peers/bin/python --model dlrm --dist zipf
    .venv/bin/python benchmarks/peers/run.py --model torchrec   # TorchRec's DLRM on hetero (#75)

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
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _common import cpu, emit  # noqa: E402

from hetero.placement.memory import MMAP_THRESHOLD, TRIM_THRESHOLD  # noqa: E402

B = 4096  # samples per step (systems.py, dlrm_systems.py)
# (name, numerator, denominator, target): ratios of rates measured in turns (paired_ratio)
RATIOS = [("rowwise_adagrad_vs_fbgemm", ("hetero", "rowwise_adagrad", True), ("fbgemm", "rowwise_adagrad", True), 1.5),
          ("rowwise_adagrad_vs_torchrec", ("hetero", "rowwise_adagrad", True), ("torchrec", "rowwise_adagrad", True), None),
          ("sgd_vs_fbgemm", ("hetero", "sgd", True), ("fbgemm", "sgd", True), 1.5),
          ("adagrad_vs_fbgemm", ("hetero", "adagrad", True), ("fbgemm", "adagrad", True), 3.0),
          ("lazy_adam_vs_torch_sparse_adam", ("hetero", "lazy_adam", True), ("torch", "lazy_adam", True), 6.0),
          ("per_id_vs_fbgemm_per_id", ("hetero", "rowwise_adagrad", False), ("fbgemm", "rowwise_adagrad", False), None),
          ("per_id_vs_fbgemm_pooled", ("hetero", "rowwise_adagrad", False), ("fbgemm", "rowwise_adagrad", True), None)]


def _env() -> dict[str, str]:
    """A system's environment: this one, with hetero's sources first on the path, and every system
    with the C allocator settings the ``hetero`` command sets for itself
    (:func:`hetero.placement.memory.retain_freed_memory`), as environment variables glibc reads at
    start: without them a process may hand a step's freed temporaries back to the kernel and fault
    them in again at the next step, or not, by chance (2026-11-28, four fresh processes of hetero's
    step: 39.6, 15.6, 11.4 and 10.1 ms), which no turn-taking evens out."""
    path = os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
            "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


class Served:
    """A system in a process of its own, timing blocks of steps when asked (``--serve``:
    ``_workload.serve``). Its stderr goes to a file, so a chatty library cannot block it.

    Raises:
        RuntimeError: the process exited before it was ready or while timing (its stderr's end)."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name, self.err = name, tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([*argv, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=_env())
        try:
            while self._line() != "ready":  # (a library's own prints come before it)
                pass
        except BaseException:  # (not ready: nothing will close it)
            self.proc.kill()
            self.proc.wait()
            raise

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            self.err.seek(0)
            raise RuntimeError(f"{self.name} exited: {self.err.read()[-2000:]}")
        return line.strip()

    def block(self, steps: int) -> float:
        """Seconds per step over ``steps`` more steps."""
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.err.close()


def interleaved(argvs: dict[str, list[str]], args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per step of each system, ``args.blocks`` blocks of ``args.block`` steps each: every
    system a process of its own, set up one after another, then taking turns block by block (which
    one first rotating), so block ``k`` of every system ran within a second of the others'. Between
    turns the coordinator waits ``args.pause`` seconds: a library's idle worker threads spin for a
    while after their last parallel region (OpenMP's wait policy), and would take the cores from
    the next system's turn."""
    served: dict[str, Served] = {}
    try:
        for name, argv in argvs.items():
            served[name] = Served(name, argv)
        seconds: dict[str, list[float]] = {name: [] for name in argvs}
        order = list(argvs)
        for k in range(args.blocks):
            for name in order[k % len(order):] + order[: k % len(order)]:
                time.sleep(args.pause)
                seconds[name].append(served[name].block(args.block))
        return seconds
    finally:
        for s in served.values():
            s.close()


def paired_ratio(a: list[float], b: list[float]) -> float:
    """The median over blocks of ``b[k] / a[k]``: ``a``'s rate over ``b``'s, block by block (what the
    machine did to both in the same second cancels)."""
    return statistics.median(y / x for x, y in zip(a, b))


def _argv(python: str, script: str, args: argparse.Namespace, *extra: str) -> list[str]:
    return [python, str(HERE / script), "--rows", str(args.rows), "--dist", args.dist, "--steps", str(args.steps),
            "--warmup", str(args.warmup), *extra]


def _key(m: tuple) -> str:
    return f"{m[0]}/{m[1]}/{'pooled' if m[2] else 'per_id'}"


def embedding(args: argparse.Namespace) -> None:
    """Every ratio of ``RATIOS`` from a pair of served processes; the per-id/pooled ratio of hetero
    in one process (``--both``); medians and ratios to ``peers_<isa>_<vendor>_cpu.json``."""
    ratios, rates = {}, {}
    for name, a, b, target in RATIOS:
        argvs = {_key(m): _argv(args.peers_python if m[0] in ("fbgemm", "torchrec") else args.hetero_python,
                                "systems.py", args, "--system", m[0], "--optimizer", m[1], *(["--pooled"] if m[2] else []))
                 for m in (a, b)}
        # a fresh pair of processes a round: where in the machine's memory a process's tables land moves
        # its speed as much as the time does (hetero's LazyAdam: 120k and 270k samples/s in two halves of
        # one process's turns, 470k in the next process)
        per_round, sec = [], {k: [] for k in argvs}
        for _ in range(args.rounds):
            got = interleaved(argvs, args)
            per_round.append(paired_ratio(got[_key(a)], got[_key(b)]))
            for k, v in got.items():
                sec[k] += v
        value = statistics.median(per_round)
        ratios[name] = {"ratio": value, "target": target, "met": None if target is None else value >= target,
                        "rounds": per_round, **{f"{k}_samples_per_s": B / statistics.median(v) for k, v in sec.items()}}
        for k, v in sec.items():
            rates.setdefault(k, []).extend(v)
        print(f"{name}: {value:.2f} (rounds {', '.join(f'{r:.2f}' for r in per_round)})", file=sys.stderr)
    rates = {k: B / statistics.median(v) for k, v in rates.items()}
    # per-id against pooled bags of one: in one process, alternating step by step
    run = subprocess.run(_argv(args.hetero_python, "systems.py", args, "--system", "hetero", "--optimizer",
                               "rowwise_adagrad", "--both"), capture_output=True, text=True,
                         env=_env())
    if run.returncode != 0:
        raise RuntimeError(f"hetero --both: {run.stderr[-2000:]}")
    value = json.loads(run.stdout.strip().splitlines()[-1])["per_id_over_pooled"]
    ratios["per_id_vs_pooled"] = {"ratio": value, "target": 1.0, "met": value >= 0.95, "same_process": True}
    # (met: within 5%, the noise of one process)
    machine = cpu()
    emit(f"peers_{machine['tag']}", {
        "workload": {"tables": 26, "rows_per_table": args.rows, "dim": 16, "batch": B, "ids_per_table": 1,
                     "dist": args.dist, "rounds": args.rounds, "blocks": args.blocks, "steps_per_block": args.block},
        "cpu": machine, "samples_per_s": rates, "ratios": ratios})


def dlrm(args: argparse.Namespace) -> None:
    """``--model dlrm``: hetero's DLRM step against TorchRec's and against its own dense part, three
    served processes taking turns; medians and paired ratios to ``peers_dlrm_<dist>_<isa>_<vendor>_cpu.json``."""
    argvs = {s: _argv(args.peers_python if s == "torchrec" else args.hetero_python, "dlrm_systems.py", args,
                      "--system", s) for s in ("hetero", "torchrec", "dense")}
    pairs = {"hetero_vs_torchrec": ("hetero", "torchrec"), "hetero_vs_dense_part": ("hetero", "dense"),
             "torchrec_vs_dense_part": ("torchrec", "dense")}
    per_round: dict[str, list[float]] = {k: [] for k in pairs}
    sec: dict[str, list[float]] = {k: [] for k in argvs}
    for _ in range(args.rounds):  # (fresh processes a round, as for the embedding step)
        got = interleaved(argvs, args)
        for k, (a, b) in pairs.items():
            per_round[k].append(paired_ratio(got[a], got[b]))
        for k, v in got.items():
            sec[k] += v
    machine = cpu()
    emit(f"peers_dlrm_{args.dist}_{machine['tag']}", {
        "workload": {"model": "dlrm", "tables": 26, "rows_per_table": args.rows, "dim": 16, "batch": B,
                     "bottom": [512, 256, 64, 16], "top": [512, 256, 1], "dist": args.dist, "rounds": args.rounds,
                     "blocks": args.blocks, "steps_per_block": args.block},
        "cpu": machine, "samples_per_s": {s: B / statistics.median(v) for s, v in sec.items()},
        "ratios": {k: statistics.median(v) for k, v in per_round.items()}, "rounds": per_round})


def torchrec_models(args: argparse.Namespace) -> None:
    """``--model torchrec``: TorchRec's own DLRM trained by TorchRec (its fused CPU kernels) and by
    TorchRec-on-hetero (``hetero.torchrec``), in memory and on the SSD tier with a tenth of the rows
    cached; three served processes in hetero's environment taking turns (issue #75, target >= 1.5x).
    Medians and paired ratios to ``torchrec_on_hetero_<dist>_<isa>_<vendor>_cpu.json``."""
    systems = ("torchrec_on_hetero", "torchrec", "torchrec_on_hetero_ssd", "torchrec_dense_part")
    argvs = {s: _argv(args.hetero_python, "dlrm_systems.py", args, "--system", s) for s in systems}
    pairs = {"torchrec_on_hetero_vs_torchrec": ("torchrec_on_hetero", "torchrec"),
             "ssd_tier_vs_memory": ("torchrec_on_hetero_ssd", "torchrec_on_hetero"),
             "ssd_tier_vs_torchrec": ("torchrec_on_hetero_ssd", "torchrec"),
             # the most any table engine can gain on this model: its dense part alone against TorchRec's step
             "dense_part_vs_torchrec": ("torchrec_dense_part", "torchrec"),
             "torchrec_on_hetero_vs_dense_part": ("torchrec_on_hetero", "torchrec_dense_part")}
    per_round: dict[str, list[float]] = {k: [] for k in pairs}
    sec: dict[str, list[float]] = {k: [] for k in argvs}
    for _ in range(args.rounds):
        got = interleaved(argvs, args)
        for k, (a, b) in pairs.items():
            per_round[k].append(paired_ratio(got[a], got[b]))
        for k, v in got.items():
            sec[k] += v
    ratios = {k: statistics.median(v) for k, v in per_round.items()}
    machine = cpu()
    emit(f"torchrec_on_hetero_{args.dist}_{machine['tag']}", {
        "workload": {"model": "torchrec.models.dlrm.DLRM", "tables": 26, "rows_per_table": args.rows, "dim": 16,
                     "batch": B, "optimizer": "exact row-wise Adagrad (fused)", "ssd_cached_rows": "1/10",
                     "dist": args.dist, "rounds": args.rounds, "blocks": args.blocks, "steps_per_block": args.block},
        "cpu": machine, "samples_per_s": {s: B / statistics.median(v) for s, v in sec.items()},
        "ratios": ratios, "target": {"torchrec_on_hetero_vs_torchrec": 1.5},
        "met": ratios["torchrec_on_hetero_vs_torchrec"] >= 1.5, "rounds": per_round})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["embedding", "dlrm", "torchrec"], default="embedding",
                   help="the embedding step alone (systems.py), the DLRM training step (dlrm_systems.py), or "
                        "TorchRec's DLRM by TorchRec and on hetero's tables (dlrm_systems.py, hetero's environment)")
    p.add_argument("--peers-python", help="the interpreter of the peers' environment (requirements.txt; not needed "
                                          "with --model torchrec: make installs TorchRec beside hetero)")
    p.add_argument("--hetero-python", default=sys.executable, help="hetero's interpreter (default: this one)")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table (26 tables x 16 fp32)")
    p.add_argument("--dist", choices=["uniform", "zipf"], default="uniform")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per ratio (the median of their ratios)")
    p.add_argument("--blocks", type=int, default=15, help="turns each system takes in a round")
    p.add_argument("--block", type=int, default=10, help="steps per turn")
    p.add_argument("--pause", type=float, default=0.3, help="seconds between turns (idle threads stop spinning)")
    p.add_argument("--steps", type=int, default=20, help="distinct batches each system cycles through")
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    if args.peers_python is None and args.model != "torchrec":
        p.error("--peers-python is needed for --model embedding and dlrm")
    {"dlrm": dlrm, "torchrec": torchrec_models, "embedding": embedding}[args.model](args)


if __name__ == "__main__":
    main()
