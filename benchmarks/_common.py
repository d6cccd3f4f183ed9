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


def emit(name: str, result: dict) -> None:
    """Write ``result`` to ``benchmarks/results/<name>.json`` and print it as the last line."""
    result = {"benchmark": name, "date": time.strftime("%Y-%m-%d"), **result, "env": environment()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if torch.cuda.is_available() else "cpu"
    (RESULTS / f"{name}_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
