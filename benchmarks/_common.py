"""Shared benchmark plumbing: environment facts and the one-JSON-line result convention."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    return env


def cpu() -> dict:
    """The CPU's vendor, model and widest vector ISA (from ``/proc/cpuinfo``), what FBGEMM's kernels
    are built for; ``tag`` (``avx512_intel``, ``avx2_amd``, ...) names a result by them, as a peer's
    kernels differ by vendor as much as by ISA (FBGEMM's row-wise Adagrad step: 534k samples/s on an
    AMD EPYC with AVX-512, 2026-11-26; 64k on an Intel Xeon with AVX-512, 2026-12-01)."""
    model, vendor, flags = "unknown", "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("vendor_id") and vendor == "unknown":
                vendor = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    short = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, "other")
    return {"model": model, "vendor": vendor, "isa": isa, "cores": os.cpu_count(), "tag": f"{isa}_{short}"}


def emit(name: str, result: dict) -> None:
    """Write ``result`` to ``benchmarks/results/<name>.json`` and print it as the last line."""
    result = {"benchmark": name, "date": time.strftime("%Y-%m-%d"), **result, "env": environment()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if torch.cuda.is_available() else "cpu"
    (RESULTS / f"{name}_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


def load_example(name: str):  # noqa: ANN201 - a module
    """The module of ``examples/<name>.py`` (examples live outside the package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spawn_ranks(fn, n: int, *args) -> dict:  # noqa: ANN001 - fn(rank, n, *args, port, out)
    """Run ``fn(rank, n, *args, port, out)`` on ``n`` spawned processes (each joins a gloo group
    on ``port``); returns what rank 0 put in the shared dict ``out``."""
    import torch.multiprocessing as mp

    import socket

    with socket.socket() as s:  # a free port now, for this group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.get_context("spawn").Manager() as manager:
        out = manager.dict()
        mp.start_processes(fn, args=(n, *args, port, out), nprocs=n, start_method="spawn")
        return dict(out)
