import logging
import sys

import pytest
import torch

from hetero.placement import Target, copy_to, resolve_device
from hetero.placement import target as target_mod


def test_target_parse_accepts_names_and_rejects_unknown():
    assert Target.parse("HOST") is Target.HOST and Target.parse("cpu") is Target.HOST
    assert Target.parse(Target.DEVICE) is Target.DEVICE
    with pytest.raises(ValueError) as err:
        Target.parse("gpu0")
    assert str(err.value) == "unknown placement target 'gpu0'; valid targets are 'host', 'device'"


def test_resolver_maps_host_to_cpu_and_device_to_cpu_without_accelerator(monkeypatch, caplog):
    monkeypatch.setattr(target_mod, "_accelerator", lambda: None)
    monkeypatch.setattr(target_mod, "_announced", set())
    assert resolve_device(Target.HOST) == torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="hetero"):
        assert resolve_device(Target.DEVICE) == torch.device("cpu")
        assert resolve_device("device") == torch.device("cpu")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["hetero: no accelerator found; the device part runs on the CPU"]  # once, not per call


def test_resolver_prefers_accelerator(monkeypatch):
    monkeypatch.setattr(target_mod, "_accelerator", lambda: torch.device("cuda", 0))
    assert resolve_device(Target.DEVICE) == torch.device("cuda", 0)
    assert resolve_device(Target.HOST) == torch.device("cpu")


def test_copy_to_same_device_is_free():
    t = torch.ones(3)
    assert copy_to(t, torch.device("cpu")) is t


FAULTS = """
import resource, sys
import torch
from hetero.placement.memory import retain_freed_memory
print(retain_freed_memory() if sys.argv[1] == "retain" else None)
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(10 << 20)  # 40 MiB allocated, written and freed, as a step's temporaries
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults)[6])  # (the median block: the heap may grow in one or two of them)
"""


def _faults_per_block(mode: str, env: dict[str, str]) -> tuple[str, float]:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True, env=env)
    applied, faults = out.stdout.split()
    return applied, float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_retained_freed_memory_is_not_faulted_in_again():
    """A 40 MiB block allocated and freed over and over (glibc by default maps blocks over 32 MiB on
    their own and unmaps them when freed: 10,240 page faults each time) is reused from the heap once
    the process keeps freed memory."""
    applied, kept = _faults_per_block("retain", {})
    assert applied == "True" and kept < 100
    _, default = _faults_per_block("default", {})
    assert default > 5000  # (the mechanism this guards against, so the check above can fail)


def test_a_malloc_variable_in_the_environment_is_left_to_rule(monkeypatch):
    from hetero.placement.memory import retain_freed_memory

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert retain_freed_memory() is False  # (returns before it changes anything in this process)


def test_the_command_line_keeps_freed_memory(monkeypatch, tmp_path):
    import importlib

    cli = importlib.import_module("hetero.cli.main")
    calls = []
    monkeypatch.setattr(cli, "retain_freed_memory", lambda: calls.append(True))
    assert cli.main(["export", "--checkpoint", str(tmp_path / "missing.pt"), "--out", str(tmp_path / "out")]) == 1
    assert calls == [True]
