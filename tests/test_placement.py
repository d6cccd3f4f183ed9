import logging

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
