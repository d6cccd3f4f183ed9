"""Recompute on the GPT example: activation memory against step time, per policy.

For each policy (none, full, keep matmul outputs, keep attention outputs) on the example's
decoder: the bytes forward keeps for backward and the peak over a whole training step, both from
the allocator (CUDA's statistics on a GPU, the profiler's allocation events on the CPU), and the
median step time (forward + backward). Gradients are checked equal to the plain model's first.

    python benchmarks/recompute.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, load_example  # noqa: E402

from hetero.optim.accounting import measure_allocations  # noqa: E402
from hetero.parallel.recompute import RecomputeConfig, RecomputeOp, apply_recompute  # noqa: E402
from hetero.placement import Target, resolve_device  # noqa: E402

POLICIES = {"none": None, "full": frozenset(), "matmul": frozenset({RecomputeOp.MATMUL}),
            "attention": frozenset({RecomputeOp.ATTENTION})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=7)
    args = p.parse_args()
    lm, device = load_example("lm_host_adam"), resolve_device(Target.DEVICE)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (args.batch, args.context), generator=g).to(device) for _ in range(2))
    result = {k: v for k, v in vars(args).items()}
    reference = None
    for name, save in POLICIES.items():
        torch.manual_seed(0)
        model = lm.Decoder(256, args.d_model, args.layers, args.heads, args.context).to(device)
        if save is not None:
            apply_recompute(model, RecomputeConfig(tuple(f"blocks.{i}" for i in range(args.layers)), save))
        keep = []
        held = measure_allocations(lambda: keep.append(lm.lm_loss(model(x), y)), device).net
        keep.pop().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        reference = reference or grads
        err = max((a - b).abs().max().item() for a, b in zip(grads, reference))
        model.zero_grad(set_to_none=True)
        peak = measure_allocations(lambda: lm.lm_loss(model(x), y).backward(), device).peak
        times = []
        for _ in range(args.steps):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            lm.lm_loss(model(x), y).backward()
            if device.type == "cuda":
                torch.cuda.synchronize()  # sync point: time the device work too
            times.append(time.perf_counter() - t0)
        result[name] = {"held_after_forward_bytes": held, "peak_step_bytes": peak, "step_s": statistics.median(times),
                        "max_grad_difference": err}
        print(f"{name}: held {held / 1e6:.1f} MB, peak {peak / 1e6:.1f} MB, step {statistics.median(times) * 1e3:.0f} ms",
              file=sys.stderr)
    for name in POLICIES:
        if name != "none":
            result[f"{name}_held_ratio"] = result[name]["held_after_forward_bytes"] / result["none"]["held_after_forward_bytes"]
            result[f"{name}_peak_ratio"] = result[name]["peak_step_bytes"] / result["none"]["peak_step_bytes"]
            result[f"{name}_time_ratio"] = result[name]["step_s"] / result["none"]["step_s"]
    emit("recompute", result)


if __name__ == "__main__":
    main()
