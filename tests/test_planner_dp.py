"""The planner's dp dimension made real by hetero.apply: a dense model's dp plan, with and without
ZeRO, on 2 gloo ranks trains as one process on the global batch (each rank its share)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetero.planner.plan import Plan
from hetero.planner.planner import Planner, PlannerConfig
from hetero.planner.space import Candidate, OptimizerKind


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _batches(steps, n=32):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(n, 16, generator=g), torch.randint(0, 8, (n,), generator=g)) for _ in range(steps)]


def _train_dp(plan_path, steps):
    from torch.distributed.tensor import DTensor

    from hetero.planner.apply import OptimizerConfig, apply

    torch.manual_seed(0)
    model = Net()
    run = apply(model, Plan.load(plan_path), OptimizerConfig(lr=0.1))
    rows = []
    model.fc1.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    losses = [run.step((x,), y, F.cross_entropy) for x, y in _batches(steps)]  # every rank: the global batch
    return losses, {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                    for n, p in model.named_parameters()}, rows


@pytest.mark.parametrize("zero,micro_batches", [(0, 2), (1, 1), (3, 1)])
def test_a_dp_plan_trains_as_one_process(tmp_path, cpu_ranks, cache, zero, micro_batches):
    from conftest import assert_trains_as_one_process, run_ranks

    x, y = _batches(1)[0]
    planner = Planner(Net(), (x,), world_size=2, loss_fn=lambda o: F.cross_entropy(o, y), optimizer=OptimizerKind.SGD,
                      config=PlannerConfig(cache_dir=cache))
    path = planner.price(Candidate(dp=2, zero=zero, micro_batches=micro_batches)).save(tmp_path / "plan.json")
    losses, trained, rows = run_ranks(tmp_path, 2, _train_dp, str(path), 3)
    assert rows == [32 // 2 // micro_batches] * 3 * micro_batches  # each rank ran its share of each batch
    assert_trains_as_one_process(Net, _batches(3), losses, trained)
