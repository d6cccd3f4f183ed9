"""The planner's tp dimension: operator strategies from sharding propagation around the user's
annotations (kept), a tp plan applied on 2 gloo ranks training as one unsharded process with
each rank holding its share of the weights, and the collectives it predicts counted on the run."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hetero
from hetero.parallel.operator_plan import ShardingPlan
from hetero.planner.plan import Plan
from hetero.planner.config import PlannerConfig
from hetero.planner.planner import Planner
from hetero.planner.space import Candidate, OptimizerKind, UnitChoice


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _batches(steps, n=32):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 16, generator=g), torch.randint(0, 8, (n,), generator=g)) for _ in range(steps)]


def _planner(cache, sharding=None, optimizer=OptimizerKind.ADAMW):
    x, y = _batches(1)[0]
    return Planner(Net(), (x,), world_size=2, loss_fn=lambda o: F.cross_entropy(o, y), sharding=sharding,
                   optimizer=optimizer, config=PlannerConfig(cache_dir=cache))


def _train_tp(plan_path, steps):
    from torch.distributed.tensor import DTensor

    from hetero.parallel.comm import CollectiveCounter
    from hetero.planner.apply import OptimizerConfig, apply

    plan = Plan.load(plan_path)
    torch.manual_seed(0)
    model = Net()
    run = apply(model, plan, OptimizerConfig(lr=0.1))
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    losses, counted = [], 0.0
    for x, y in _batches(steps):
        run.optimizers.dense.zero_grad()
        with CollectiveCounter() as counter:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        counted = counter.total_bytes
        run.optimizers.dense.step()
        losses.append(float(loss.detach()))
    whole = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    return whole, losses, local, counted


def test_a_tp_plan_trains_as_one_unsharded_process_and_sends_what_it_predicts(tmp_path, cpu_ranks, cache):
    from conftest import assert_trains_as_one_process, run_ranks

    # SGD: Adam's first steps turn float rounding in near-zero gradients into lr-sized moves
    planner = _planner(cache, optimizer=OptimizerKind.SGD)
    plan = planner.price(Candidate(tp=2))
    strategies = {k: v.in_strategy for k, v in plan.sharding.items()}
    # propagation pairs the layers as Megatron does: fc1's outputs cut, fc2's contraction cut
    assert strategies["fc1"] == ((1, 1), (1, 2)) and strategies["fc2"] == ((1, 2), (2, 1))
    assert plan.sharding["fc3"].use_local_output  # the loss takes a whole, plain tensor
    path = plan.save(tmp_path / "plan.json")
    assert Plan.load(path).sharding == plan.sharding
    whole, losses, local, counted = run_ranks(tmp_path, 2, _train_tp, str(path), 3)

    ref = assert_trains_as_one_process(Net, _batches(3), losses, whole)
    # each rank holds its share of the cut weights (the plan's layout), the rest whole
    expected = sum(p.numel() // (2 if f"{n}" in plan.layout and "S" in plan.layout[n][-1] else 1)
                   for n, p in ref.named_parameters())
    assert local == expected < sum(p.numel() for p in ref.parameters())
    assert counted > 0 and counted == pytest.approx(planner.tensor[2].bytes_per_step())


def test_sharding_annotations_are_kept_and_bad_ones_refused_naming_the_fix(tmp_path, cache):
    kept = ShardingPlan().module("fc2", ((2, 1), (1, 1)))  # fc2 cut by rows: not what propagation picks alone
    plan = _planner(cache, kept).plan()
    assert plan.candidate.tp == 2  # an annotation that cuts operators is kept: only tp plans
    assert plan.sharding["fc2"].in_strategy == ((2, 1), (1, 1)) and plan.kept_sharding == ("fc2",)
    assert "fc2: ((2, 1), (1, 1)) (kept annotation)" in str(hetero.explain(plan))
    assert Plan.load(plan.save(tmp_path / "p.json")).kept_sharding == ("fc2",)
    with pytest.raises(ValueError, match=r"'fc9'.*\['fc1', 'fc2', 'fc3'\]"):
        _planner(cache, ShardingPlan().module("fc9", ((1, 1), (1, 2))))
    with pytest.raises(ValueError, match="fit no tensor-parallel degree of 2"):
        _planner(cache, ShardingPlan().module("fc1", ((1, 1), (1, 4))))


def test_without_annotations_or_ranks_there_is_no_tp(cache):
    x, y = _batches(1)[0]
    one = Planner(Net(), (x,), loss_fn=lambda o: F.cross_entropy(o, y), config=PlannerConfig(cache_dir=cache))
    assert one.tensor == {} and {c.tp for c in one.settings} == {1}
    two = _planner(cache)
    assert {c.tp for c in two.settings} == {1, 2}
    assert all(c.state.value == "device" for c in two.settings if c.tp == 2)  # HostAdamW keeps whole masters
    with pytest.raises(ValueError, match="no operator strategies at that degree"):
        one.price(Candidate(tp=2))
    # a Linear on (batch, seq, in) inputs: apply_sharding cuts 2-D inputs only, so no tp plan is offered
    seq = Planner(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)), (torch.randn(8, 4, 16),),
                  world_size=2, config=PlannerConfig(cache_dir=cache))
    assert seq.tensor == {} and {c.tp for c in seq.settings} == {1}


def _train_dp_tp(plan_path, steps):
    from torch.distributed.tensor import DTensor

    from hetero.planner.apply import OptimizerConfig, apply

    torch.manual_seed(0)
    model = Net()
    run = apply(model, Plan.load(plan_path), OptimizerConfig(lr=0.1))
    rows, local = [], {n: p.to_local().shape for n, p in model.named_parameters() if isinstance(p, DTensor)}
    model.fc1.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    losses = [run.step((x,), y, F.cross_entropy) for x, y in _batches(steps)]  # every rank: the global batch
    whole = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    return losses, whole, rows, local


@pytest.mark.parametrize("zero", [0, 3])
def test_a_dp_by_tp_plan_trains_as_one_process(tmp_path, cpu_ranks, cache, zero):
    """4 ranks, mesh dp 2 x tp 2: each replica's two ranks cut the operators, each replica runs
    half the batch, the replicas' gradients meet (torch's replicate, or FSDP2 at ZeRO 3)."""
    from conftest import assert_trains_as_one_process, run_ranks

    x, y = _batches(1)[0]
    planner = Planner(Net(), (x,), world_size=4, loss_fn=lambda o: F.cross_entropy(o, y), optimizer=OptimizerKind.SGD,
                      config=PlannerConfig(cache_dir=cache))
    assert {c.zero for c in planner.settings if c.tp == 2 and c.dp == 2} == {0, 2, 3}  # no ZeRO 1 beside tp
    plan = planner.price(Candidate(dp=2, tp=2, zero=zero))
    losses, whole, rows, local = run_ranks(tmp_path, 4, _train_dp_tp, str(plan.save(tmp_path / "plan.json")), 3)
    assert rows == [32 // 2] * 3  # each replica ran its half of each batch
    # fc1's columns cut over tp (and its rows over dp at ZeRO 3): a quarter or a half of the weight here
    assert local["fc1.weight"] == ((64 // 2 // 2, 16) if zero == 3 else (64 // 2, 16))
    assert_trains_as_one_process(Net, _batches(3), losses, whole)


def _train_tp_host(plan_path, steps):
    from torch.distributed.tensor import DTensor

    from hetero.parallel.comm import CollectiveCounter
    from hetero.planner.apply import OptimizerConfig, apply

    torch.manual_seed(0)
    model = Net()
    run = apply(model, Plan.load(plan_path), OptimizerConfig(lr=0.1))
    losses, counted = [], 0.0
    for x, y in _batches(steps):
        with CollectiveCounter() as counter:
            losses.append(run.step((x,), y, F.cross_entropy))
        counted = counter.total_bytes
    whole = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    hosted = sorted(n for n, p in model.named_parameters() if p in run.host_tensors and not isinstance(p, DTensor))
    return losses, whole, hosted, counted


def test_a_unit_pinned_to_the_host_runs_whole_beside_tp_and_trains_as_one_process(tmp_path, cpu_ranks, cache):
    """A user pins fc2 to the host: tp 2 cuts fc1 and fc3 around it, every value into and out
    of it whole and plain (the partitioner's host subgraph takes no DTensor), each rank running
    it whole on its host; the plan trains as one unsharded process and sends what it predicts."""
    from conftest import assert_trains_as_one_process, run_ranks
    from hetero.placement import PlacementSpec, Target

    x, y = _batches(1)[0]
    planner = Planner(Net(), (x,), world_size=2, loss_fn=lambda o: F.cross_entropy(o, y), optimizer=OptimizerKind.SGD,
                      placement=PlacementSpec().module("fc2", Target.HOST), config=PlannerConfig(cache_dir=cache))
    assert {(c.dp, c.tp) for c in planner.settings} == {(2, 1), (1, 2)}  # (not dp x tp: replicate takes no partition)
    plan = planner.price(Candidate(tp=2), {"fc2": UnitChoice(Target.HOST)})
    assert set(plan.sharding) == {"fc1", "fc3"} and plan.sharding["fc1"].use_local_output  # fc2 takes it whole
    losses, whole, hosted, counted = run_ranks(tmp_path, 2, _train_tp_host, str(plan.save(tmp_path / "plan.json")), 3)
    assert hosted == ["fc2.bias", "fc2.weight"]
    assert_trains_as_one_process(Net, _batches(3), losses, whole)
    assert counted > 0 and counted == pytest.approx(planner.tensor[2].bytes_per_step())
    with pytest.raises(ValueError, match="pinned to the host, which runs whole"):
        Planner(Net(), (x,), world_size=2, placement=PlacementSpec().module("fc2", Target.HOST),
                sharding=ShardingPlan().module("fc2", ((1, 1), (1, 2))), config=PlannerConfig(cache_dir=cache))


@pytest.mark.parametrize("zero", [0, 3])
def test_a_unit_pinned_to_the_host_runs_whole_beside_dp_by_tp(tmp_path, cpu_ranks, cache, zero):
    """4 ranks, dp 2 x tp 2, fc2 pinned to the host: each replica's tp ranks cut fc1 and fc3 and
    run fc2 whole; the replicas' device gradients meet in torch's replicate (or FSDP2 at ZeRO
    3), each around the partitioned model, fc2's in HostReplicaOptimizer's all-reduce."""
    from conftest import assert_trains_as_one_process, run_ranks
    from hetero.placement import PlacementSpec, Target

    x, y = _batches(1)[0]
    planner = Planner(Net(), (x,), world_size=4, loss_fn=lambda o: F.cross_entropy(o, y), optimizer=OptimizerKind.SGD,
                      placement=PlacementSpec().module("fc2", Target.HOST), config=PlannerConfig(cache_dir=cache))
    c = Candidate(dp=2, tp=2, zero=zero)
    assert c in planner.settings
    plan = planner.price(c, {"fc2": UnitChoice(Target.HOST)})
    losses, whole, hosted, _ = run_ranks(tmp_path, 4, _train_tp_host, str(plan.save(tmp_path / "plan.json")), 3)
    assert hosted == ["fc2.bias", "fc2.weight"]
    assert_trains_as_one_process(Net, _batches(3), losses, whole)
