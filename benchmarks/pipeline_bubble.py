"""Pipeline bubble: the idle fraction each rank measures against the schedule's prediction.

Two gloo ranks (pp = 2) run a stack of equal-cost layers: each layer's forward sleeps ``F`` ms
and its backward ``2 F`` ms (on CPU, sleeping makes the stages equal-cost and keeps the two
ranks from competing for this machine's two cores). 1F1B holds one stage per rank; interleaved
1F1B two (each half the cost, so a rank's work per micro-batch is the same). For m = 1, 2, 4, 8
micro-batches: the measured bubble (``Pipeline.measured_bubble``: 1 - the ranks' mean busy time
over the step's time, the median of the steps after a warm-up) beside ``predicted_bubble``.

    python benchmarks/pipeline_bubble.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, spawn_ranks  # noqa: E402


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):  # noqa: ANN001, ANN205
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        time.sleep(2 * ctx.seconds)
        return grad, None


class Layer(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.fc, self.seconds = nn.Linear(16, 16), seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.fc(x), self.seconds)


class Stack(nn.Module):
    def __init__(self, layers: int, seconds: float) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Layer(seconds) for i in range(layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def _rank(rank: int, n: int, schedule: str, micro_batches: int, layer_ms: float, steps: int, port: int,
          out: dict) -> None:  # spawn_ranks
    from hetero.parallel.mesh import MeshConfig, build_mesh
    from hetero.parallel.pipeline import pipeline
    from hetero.parallel.pipeline_plan import PipelineConfig, Schedule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(1)
    config = PipelineConfig(Schedule(schedule), micro_batches, stages_per_rank=2 if "interleaved" in schedule else 1)
    stages = n * config.stages_per_rank
    torch.manual_seed(0)
    # a rank's work per micro-batch is layer_ms forward whatever the number of stages it holds
    model = Stack(stages, layer_ms / 1e3 / config.stages_per_rank)
    pipe = pipeline(model, config, build_mesh(MeshConfig(pp=n)), lambda y, t: ((y - t) ** 2).mean())
    bubbles = []
    for step in range(steps):
        x, t = torch.randn(micro_batches * 2, 16), torch.randn(micro_batches * 2, 16)
        pipe.step(x, t)
        bubble = pipe.bubble  # measured by every step
        if step:  # the first step also exchanges shapes
            bubbles.append(bubble)
    if rank == 0:
        out["bubble"] = statistics.median(bubbles)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layer-ms", type=float, default=20.0, help="forward sleep of one rank's stage per micro-batch")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    from hetero.parallel.pipeline_plan import Schedule, predicted_bubble

    result: dict = {"pp": 2, "layer_ms": args.layer_ms}
    worst = 0.0
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B):
        v = 2 if schedule.interleaved else 1
        for m in (1, 2, 4, 8):
            key = f"{schedule.value}_m{m}"
            try:
                measured = spawn_ranks(_rank, 2, schedule.value, m, args.layer_ms, args.steps)["bubble"]
            except Exception as e:  # noqa: BLE001 - a schedule that refuses this m: recorded, not fatal
                result[key] = {"error": str(e).strip().splitlines()[-1][:200]}
                continue
            predicted = predicted_bubble(schedule, 2, m, v)
            worst = max(worst, abs(measured - predicted))
            result[key] = {"measured": measured, "predicted": predicted}
            print(f"{key}: bubble measured {measured:.3f}, predicted {predicted:.3f}", file=sys.stderr)
    result["max_abs_difference"] = worst
    emit("pipeline_bubble", result)


if __name__ == "__main__":
    main()
