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
    "dlrm_overlap": ["dlrm_overlap.py", "--rows", "2000", "--blocks", "1", "--block", "2"],
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


def test_the_ssd_tiers_job_case_runs(tmp_path):
    """``ssd_tier.py``'s whole-job case (a DLRM over tables in memory, on the tier, and on the tier
    under the prefetcher), at a size of seconds: its line of rates and counts."""
    argv = [str(ROOT / "benchmarks" / "ssd_tier.py"), "--one", "job", "zipf", "lfu", "--rows", "4000", "--cache",
            "0.75", "--steps", "5", "--warmup", "1", "--dir", str(tmp_path)]
    got = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    result = json.loads(got.stdout.strip().splitlines()[-1])
    assert result["ssd_over_memory"] > 0 and result["ssd_prefetch_over_memory"] > 0
    assert result["ssd_prefetch"]["read_ahead"] > 0 and result["ssd"]["read_ahead"] == 0  # (only that tier read ahead)
    assert 0 < result["ssd"]["hit_rate"] < 1


def test_the_ssd_tiers_job_runs_in_pairs_of_processes(tmp_path):
    """``--job-processes``: the job's tables on the tier and in memory in fresh processes (the
    issue's 26 x 4M rows cannot be held both ways in one), at a size of seconds: its result file,
    a pair's ratio and the tier's counts."""
    argv = [str(ROOT / "benchmarks" / "ssd_tier.py"), "--job-processes", "1", "--rows", "4000", "--cache", "0.75",
            "--steps", "3", "--warmup", "1", "--dir", str(tmp_path), "--name", "ssd_tier_pairs"]
    code = RUN.format(bench=str(ROOT / "benchmarks"), out=str(tmp_path), argv=argv)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    (file,) = tmp_path.glob("ssd_tier_pairs*.json")
    result = json.loads(file.read_text())
    (pair,) = result["zipf"]["job_processes"]
    assert result["job_ssd_over_memory_zipf"] == pair["ssd_over_memory"] > 0
    assert 0 < pair["ssd"]["hit_rate"] < 1 and pair["ssd"]["segments_cleaned"] > 0 and "hit_rate" not in pair["memory"]
