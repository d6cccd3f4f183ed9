"""Measure, in a fresh process, how much resident memory training state adds, next to what
``device_memory_report`` counts; prints one JSON line. (A long-lived test process reuses freed
pages, which hides growth.)"""

import json
import os

import torch
from torch import nn

from hetero.optim import HostAdamW, device_memory_report


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def step(model, opt):
    opt.zero_grad()
    x = torch.randn(8, next(model.parameters()).shape[1], dtype=next(model.parameters()).dtype)
    model(x).float().square().mean().backward()
    opt.step()


torch.manual_seed(0)
warm = nn.Linear(64, 64)  # torch's one-time allocations (thread pools, kernels) before measuring
if torch.cuda.is_available():  # and CUDA's (its context, ~100 MB of host memory on an H100 machine):
    torch.empty(1, pin_memory=True)  # HostAdamW's first pinned buffer would start it inside the measurement
step(warm, torch.optim.AdamW(warm.parameters()))
out = {}
ref = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048))
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
before = rss()
step(ref, ref_opt)  # gradients and two moments appear
out["adamw_grew"], out["adamw"] = rss() - before, device_memory_report(ref, ref_opt)
model = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048)).bfloat16()
before = rss()
opt = HostAdamW(model.named_parameters(), lr=1e-2)  # masters, moments and gradient buffers appear
out["host_grew"] = rss() - before
step(model, opt)
out["host"] = device_memory_report(model, opt)
print(json.dumps(out))
