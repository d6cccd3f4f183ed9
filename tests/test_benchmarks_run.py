"""The benchmarks whose code follows hetero's APIs most closely still run, at sizes of seconds:
nothing else runs them between their measured runs (``benchmarks/ps.py`` stopped on an
``AttributeError`` for three days when a pulled lookup's gradient changed type). Each runs in a
process of its own with its results written to a temporary directory, not ``benchmarks/results``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (results under tmp: _common.emit reads RESULTS when it writes)
RUN = """import runpy, sys
from pathlib import Path
sys.path.insert(0, {bench!r})
import _common
_common.RESULTS = Path({out!r})
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
CASES = {
    "ps": ["ps.py", "--steps", "2", "--warmup", "1", "--servers", "1"],
    "embedding_step_dynamic": ["embedding_step.py", "--rows", "2000", "--steps", "6", "--warmup", "1", "--dynamic"],
    "dlrm_step": ["dlrm_step.py", "--rows", "2000", "--blocks", "1", "--block", "2"],
    "train_step": ["train_step.py", "--batch-size", "256", "--rows", "2000", "--steps", "2", "--warmup", "1"],
}


@pytest.mark.parametrize("name", CASES)
def test_the_benchmark_runs_and_writes_its_result(tmp_path, name):
    script, *args = CASES[name]
    argv = [str(ROOT / "benchmarks" / script), *args]
    code = RUN.format(bench=str(ROOT / "benchmarks"), out=str(tmp_path), argv=argv)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    (result,) = tmp_path.glob("*.json")
    assert json.loads(result.read_text())["benchmark"] == name
    assert json.loads(got.stdout.strip().splitlines()[-1])["benchmark"] == name  # (its last line printed)
