"""The planner's dp dimension made real by hetero.apply: a dense model's dp plan, with and without
ZeRO, with a unit on the host (every replica's, its gradients averaged beside DDP's) and with the
optimizer state on the host, on 2 gloo ranks trains as one process on the global batch (each rank
its share)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetero.planner.plan import Plan
from hetero.planner.config import PlannerConfig
from hetero.planner.planner import Planner
from hetero.placement import Target
from hetero.optim import SparseOptimizerKind
from hetero.planner.space import STREAMED, Candidate, OptimizerKind, StateHome, TablePlacement, UnitChoice


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _batches(steps, n=32):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(n, 16, generator=g), torch.randint(0, 8, (n,), generator=g)) for _ in range(steps)]


def _train_dp(plan_path, steps, lr=0.1):
    from torch.distributed.tensor import DTensor

    from hetero.planner.apply import OptimizerConfig, apply

    torch.manual_seed(0)
    model = Net()
    run = apply(model, Plan.load(plan_path), OptimizerConfig(lr=lr))
    rows = []
    # (fc2: a streamed fc1 is traced through, its hooks never run)
    model.fc2.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    losses = [run.step((x,), y, F.cross_entropy) for x, y in _batches(steps)]  # every rank: the global batch
    hosted = sorted(n for n, p in model.named_parameters() if p in run.host_tensors)
    return losses, {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                    for n, p in model.named_parameters()}, rows, hosted


@pytest.mark.parametrize("zero,micro_batches", [(0, 2), (1, 1), (3, 1)])
def test_a_dp_plan_trains_as_one_process(tmp_path, cpu_ranks, cache, zero, micro_batches):
    from conftest import assert_trains_as_one_process, run_ranks

    x, y = _batches(1)[0]
    planner = Planner(Net(), (x,), world_size=2, loss_fn=lambda o: F.cross_entropy(o, y), optimizer=OptimizerKind.SGD,
                      config=PlannerConfig(cache_dir=cache))
    path = planner.price(Candidate(dp=2, zero=zero, micro_batches=micro_batches)).save(tmp_path / "plan.json")
    losses, trained, rows, _ = run_ranks(tmp_path, 2, _train_dp, str(path), 3)
    assert rows == [32 // 2 // micro_batches] * 3 * micro_batches  # each rank ran its share of each batch
    assert_trains_as_one_process(Net, _batches(3), losses, trained)


@pytest.mark.parametrize("zero,micro_batches,choice", [(0, 1, UnitChoice(Target.HOST)), (1, 2, UnitChoice(Target.HOST)),
                                                       (3, 1, UnitChoice(Target.HOST)), (2, 2, UnitChoice(Target.HOST)),
                                                       (0, 2, STREAMED), (1, 1, STREAMED), (3, 2, STREAMED)])
def test_a_dp_plan_with_a_host_unit_trains_as_one_process(tmp_path, cpu_ranks, cache, zero, micro_batches, choice):
    """A host unit, or a device unit whose weights live on the host (streamed each pass): every
    replica's parameters on its host, their gradients averaged beside DDP's (or FSDP2's, which
    shards the device units and holds the partitioned model as its root)."""
    from conftest import assert_trains_as_one_process, run_ranks

    x, y = _batches(1)[0]
    planner = Planner(Net(), (x,), world_size=2, loss_fn=lambda o: F.cross_entropy(o, y), optimizer=OptimizerKind.SGD,
                      config=PlannerConfig(cache_dir=cache))
    c = Candidate(dp=2, zero=zero, micro_batches=micro_batches)
    assert choice in planner.cost.options(0, c)
    path = planner.price(c, {"fc1": choice}).save(tmp_path / "plan.json")
    losses, trained, rows, hosted = run_ranks(tmp_path, 2, _train_dp, str(path), 3)
    assert hosted == ["fc1.bias", "fc1.weight"]  # every replica holds the host unit's parameters on its host
    assert rows == [32 // 2 // micro_batches] * 3 * micro_batches
    assert_trains_as_one_process(Net, _batches(3), losses, trained)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Blocks(nn.Module):
    """A device unit that is no leaf (its forward would be traced into) and a parameter of the
    root's (no unit holds it: FSDP2's root shards it)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.block = nn.Linear(16, 64), Block()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return self.block(torch.relu(self.fc1(x))) * self.scale


def _train_blocks(plan_path, steps):
    from torch.distributed.tensor import DTensor

    from hetero.planner.apply import OptimizerConfig, apply

    torch.manual_seed(0)
    model = Blocks()
    run = apply(model, Plan.load(plan_path), OptimizerConfig(lr=0.1))
    losses = [run.step((x,), y, F.cross_entropy) for x, y in _batches(steps)]
    local = {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in model.named_parameters()}
    return losses, {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                    for n, p in model.named_parameters()}, local


@pytest.mark.parametrize("zero,choice", [(3, UnitChoice(Target.HOST)), (2, STREAMED)])
def test_zero_shards_the_device_units_around_host_units(tmp_path, cpu_ranks, cache, zero, choice):
    """FSDP2 over the device units (a block whose forward the partitioner must not trace into:
    its gathers are hooks) and the root's own parameter, the host unit's (or streamed weights')
    left whole on every replica's host: each rank holds half the device parameters and the
    replicas train as one process."""
    from conftest import assert_trains_as_one_process, run_ranks

    x, y = _batches(1)[0]
    planner = Planner(Blocks(), (x,), world_size=2, loss_fn=lambda o: F.cross_entropy(o, y), optimizer=OptimizerKind.SGD,
                      config=PlannerConfig(cache_dir=cache))
    c = Candidate(dp=2, zero=zero)
    assert choice in planner.cost.options(0, c)
    plan = planner.price(c, {"fc1": choice})
    assert "block" in plan.units  # (a unit of its own)
    losses, trained, local = run_ranks(tmp_path, 2, _train_blocks, str(plan.save(tmp_path / "plan.json")), 3)
    whole = {n: p.numel() for n, p in Blocks().named_parameters()}
    assert local == {n: k if n.startswith("fc1.") else k // 2 for n, k in whole.items()}
    assert_trains_as_one_process(Blocks, _batches(3), losses, trained)


@pytest.mark.parametrize("state,ratio,unit", [(StateHome.HOST, 1.0, "fc2"), (StateHome.PARTIAL, 0.5, None)])
def test_a_dp_plan_with_its_state_on_the_host_trains_as_one_process(tmp_path, cpu_ranks, cache, state, ratio, unit):
    """All of the state on the host: HostAdamW averages the device part's gradients itself (no
    DDP), a host unit's beside it. Half of it (fc1.weight's, the largest): HostAdamW averages
    that part, DDP the rest. torch's AdamW on one process on the global batch is the reference."""
    from conftest import run_ranks

    x, y = _batches(1)[0]
    planner = Planner(Net(), (x,), world_size=2, loss_fn=lambda o: F.cross_entropy(o, y), optimizer=OptimizerKind.ADAMW,
                      config=PlannerConfig(cache_dir=cache))
    plan = planner.price(Candidate(dp=2, state=state, offload_ratio=ratio), {unit: UnitChoice(Target.HOST)} if unit else {})
    losses, trained, _, hosted = run_ranks(tmp_path, 2, _train_dp, str(plan.save(tmp_path / "plan.json")), 3, 0.01)
    assert hosted == ([f"{unit}.bias", f"{unit}.weight"] if unit else [])
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    want = []
    for bx, by in _batches(3):
        opt.zero_grad()
        loss = F.cross_entropy(ref(bx), by)
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
    assert losses == pytest.approx(want, abs=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def _replica_grads():
    import torch.distributed as dist

    from hetero.parallel.data_parallel import HostReplicaOptimizer

    used, unused, elsewhere = (nn.Parameter(torch.ones(3)) for _ in range(3))
    opt = HostReplicaOptimizer(torch.optim.SGD([used, unused, elsewhere], lr=1.0))
    rank = dist.get_rank()
    used.grad = torch.full((3,), float(rank + 1))
    if rank == 0:
        elsewhere.grad = torch.full((3,), 4.0)  # this rank's alone: the other contributes zeros
    opt.step()
    return [None if p.grad is None else p.grad.tolist() for p in (used, unused, elsewhere)], \
        [p.detach().tolist() for p in (used, unused, elsewhere)]


def test_host_replicas_average_their_gradients_and_leave_an_unused_parameter_alone(tmp_path, cpu_ranks):
    from conftest import run_ranks

    grads, params = run_ranks(tmp_path, 2, _replica_grads)
    assert grads == [[1.5] * 3, None, [2.0] * 3]  # the mean over the ranks; none where no rank had one
    assert params == [[-0.5] * 3, [1.0] * 3, [-1.0] * 3]  # the unused one not stepped


def test_a_dp_ranks_work_is_priced_at_its_share_of_the_batch(cache):
    """A dp 2 rank's units cost what the same model planned on half the batch costs: their ops
    timed at the share's own shapes (the global batch's scaled was 40% off for GPT). (The loss
    is the default sum: a user's loss holds the global batch's target, so the share's is a sum.)"""
    x = _batches(1)[0][0]
    config = PlannerConfig(cache_dir=cache)
    two = Planner(Net(), (x,), world_size=2, optimizer=OptimizerKind.SGD, config=config)
    half = Planner(Net(), (x[:16],), optimizer=OptimizerKind.SGD, config=config)
    assert two.cost.shares[2].batch == 16
    for i, name in enumerate(two.cost.names()):
        for choice in (UnitChoice(Target.DEVICE), UnitChoice(Target.HOST)):
            got, want = two.cost.unit(i, choice, Candidate(dp=2)), half.cost.unit(i, choice, Candidate())
            assert got.seconds == pytest.approx(want.seconds, rel=1e-9), (name, choice)


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _train_norm(plan_path):
    """Every replica's buffers after 3 steps (each rank's share of each batch differs): rank 0's
    result holds all ranks' (gathered)."""
    import torch.distributed as dist

    from hetero.planner.apply import OptimizerConfig, apply

    torch.manual_seed(0)
    model = NormNet()
    run = apply(model, Plan.load(plan_path), OptimizerConfig(lr=0.01))
    for x, y in _batches(3):
        run.step((x,), y, F.cross_entropy)
    mine = torch.cat([b.detach().float().cpu().reshape(-1) for b in model.bn.buffers()])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return every, model.bn.running_mean in run.host_tensors


@pytest.mark.parametrize("hosted,state,zero", [(True, StateHome.DEVICE, 0), (False, StateHome.HOST, 0),
                                               (False, StateHome.DEVICE, 3)])
def test_the_replicas_keep_one_set_of_buffers_without_ddp_taking_them(tmp_path, cpu_ranks, cache, hosted, state, zero):
    """BatchNorm's running statistics on the host beside DDP, or on the device with no DDP (the
    AdamW state on the host; FSDP2 at ZeRO 3): rank 0's after every step, as DDP keeps its own."""
    from conftest import run_ranks

    x, y = _batches(1)[0]
    planner = Planner(NormNet(), (x,), world_size=2, loss_fn=lambda o: F.cross_entropy(o, y),
                      optimizer=OptimizerKind.ADAMW, config=PlannerConfig(cache_dir=cache))
    plan = planner.price(Candidate(dp=2, state=state, offload_ratio=1.0 if state is StateHome.HOST else 0.0, zero=zero),
                         {"bn": UnitChoice(Target.HOST if hosted else Target.DEVICE)})
    every, on_host = run_ranks(tmp_path, 2, _train_norm, str(plan.save(tmp_path / "plan.json")))
    assert on_host == hosted
    assert not torch.equal(every[0][:64], torch.zeros(64))  # the statistics moved
    assert torch.equal(every[0], every[1])


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_the_host_units_optimizer_lists_their_parameters_in_the_models_order(cache):
    """Its state, and the replicas' flat all-reduce of their gradients, are laid out by that order:
    a set's would differ between processes (an all-reduce summing one rank's weight with another's
    bias; a checkpoint's state loaded onto the wrong parameters)."""
    from hetero.planner.apply import OptimizerConfig, apply

    x = torch.randn(8, 16)
    model = Deep()
    planner = Planner(model, (x,), optimizer=OptimizerKind.ADAMW, config=PlannerConfig(cache_dir=cache))
    plan = planner.price(Candidate(), {f"layers.{i}": UnitChoice(Target.HOST) for i in range(6)})
    run = apply(model, plan, OptimizerConfig())
    names = [n for p in run.optimizers.host_dense[0].param_groups[0]["params"] for n, q in model.named_parameters() if q is p]
    assert names == [n for n, _ in model.named_parameters()]


def test_a_host_unit_beside_zero_3_leaves_fsdps_collectives(cache):
    """FSDP2 gathers and reduce-scatters every pass; a unit on the host is averaged by one
    all-reduce instead (HostReplicaOptimizer): its cost carries its share of the difference
    between ZeRO 3's collectives and an all-reduce, which ZeRO 0 (DDP's all-reduce) has none of."""
    x, y = _batches(1)[0]
    planner = Planner(Net(), (x,), world_size=2, loss_fn=lambda o: F.cross_entropy(o, y), optimizer=OptimizerKind.SGD,
                      config=PlannerConfig(cache_dir=cache))
    cost = planner.cost

    i = cost.names().index("fc1")
    c0, c3 = Candidate(dp=2, micro_batches=2), Candidate(dp=2, zero=3, micro_batches=2)
    dense = sum(u.param_bytes for u in cost.units)
    zero0, zero3 = cost.gradient_seconds(c0, dense), cost.gradient_seconds(c3, dense)  # what fixed() prices
    assert zero3 > 0 and zero0 > 0  # (which is dearer depends on this machine's calibrated rates)
    # the host unit's own cost: the same work, less its share of what ZeRO 3 adds to DDP's all-reduce
    got = cost.unit(i, UnitChoice(Target.HOST), c0).seconds - cost.unit(i, UnitChoice(Target.HOST), c3).seconds
    assert got == pytest.approx(cost.units[i].param_bytes / dense * (zero3 - zero0), rel=1e-6)


def _clicks(steps, n=32):
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        features = {f"C{i}": (torch.rand(n, generator=g) ** 2 * 50).long() for i in range(3)}  # skewed: shared rows
        out.append(((features, torch.randn(n, 4, generator=g)), (torch.rand(n, generator=g) < 0.3).float()))
    return out


def _dlrm():
    from hetero.models.dlrm import DLRM, DLRMConfig
    from hetero.models.wide_deep import FeatureSlot

    torch.manual_seed(0)
    return DLRM([FeatureSlot(f"C{i}", 50) for i in range(3)], 4, DLRMConfig(8, (16,), (16,)))


def _train_tables(plan_path, steps):
    """Losses and the whole model after ``steps`` (row-sharded tables gathered whole)."""
    from hetero.parallel.full_state import full_model_state
    from hetero.planner.apply import OptimizerConfig, apply

    model = _dlrm()
    run = apply(model, Plan.load(plan_path), OptimizerConfig(lr=0.05), {"": SparseOptimizerKind.SGD})
    losses = [run.step(inputs, y, F.binary_cross_entropy_with_logits) for inputs, y in _clicks(steps)]
    rows = sum(t.weight.shape[0] for t in model.deep.tables.values())  # this rank's rows
    return losses, {k: v.detach().clone() for k, v in full_model_state(model).items()}, rows


@pytest.mark.parametrize("tables,micro_batches", [(TablePlacement.REPLICATED, 1), (TablePlacement.ROW_SHARDED, 1),
                                                  (TablePlacement.REPLICATED, 2), (TablePlacement.ROW_SHARDED, 2)])
def test_a_dp_plan_places_host_tables_and_trains_as_one_process(tmp_path, cpu_ranks, cache, tables, micro_batches):
    """A DLRM's dp 2 plan: its host tables replicated (sparse gradients all-gathered) or
    row-sharded (each row's gradient to its owner), its MLPs under DDP; equal to the same model
    planned for one process on the global batch."""
    from conftest import run_ranks

    (inputs, y), = _clicks(1)
    loss = lambda o: F.binary_cross_entropy_with_logits(o, y)  # noqa: E731
    two = Planner(_dlrm(), inputs, world_size=2, loss_fn=loss, optimizer=OptimizerKind.SGD,
                  config=PlannerConfig(cache_dir=cache, micro_batches=(1,)))
    assert Candidate(dp=2, tables=tables) in two.settings
    c = Candidate(dp=2, tables=tables, micro_batches=micro_batches)  # (2: each rank's two passes exchange once)
    losses, trained, rows = run_ranks(tmp_path, 2, _train_tables, str(two.price(c).save(tmp_path / "two.json")), 3)
    one = Planner(_dlrm(), inputs, loss_fn=loss, optimizer=OptimizerKind.SGD,
                  config=PlannerConfig(cache_dir=cache, micro_batches=(1,)))
    want, reference, whole = _train_tables(str(one.price(Candidate()).save(tmp_path / "one.json")), 3)
    assert rows == (whole // 2 if tables is TablePlacement.ROW_SHARDED else whole)  # rank 0's share of the rows
    assert losses == pytest.approx(want, abs=1e-6)
    assert trained.keys() == reference.keys()
    for name, t in reference.items():
        # (the ranks run on the CPU (gloo); one process on a GPU where there is one)
        torch.testing.assert_close(trained[name], t.cpu(), atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_a_table_placement_pays_for_its_sparse_exchange(cache):
    """Beside dp the host tables' sparse gradients are exchanged (DistributedSparse): replicated
    tables all-gather every rank's distinct rows once per step, row-sharded ones all-to-all
    each pass's lookups and once the gradient rows; one rank exchanges nothing."""
    import dataclasses

    (inputs, y), = _clicks(1)
    planner = Planner(_dlrm(), inputs, world_size=2, loss_fn=lambda o: F.binary_cross_entropy_with_logits(o, y),
                      optimizer=OptimizerKind.SGD, config=PlannerConfig(cache_dir=cache))
    cost = planner.cost
    i = next(k for k, u in enumerate(cost.units) if u.tables)
    quiet = dataclasses.replace(cost.tables.cal, collectives={})  # (no gloo rates: no exchange priced)

    def exchange(tables, m):
        c = Candidate(dp=2, tables=tables, micro_batches=m)
        with_it = cost._unit(i, UnitChoice(Target.HOST), c).seconds
        cost.tables.cal, kept = quiet, cost.tables.cal
        try:
            return with_it - cost._unit(i, UnitChoice(Target.HOST), c).seconds
        finally:
            cost.tables.cal = kept

    replicated, sharded = (exchange(t, 1) for t in (TablePlacement.REPLICATED, TablePlacement.ROW_SHARDED))
    assert replicated > 0 and sharded > 0
    assert exchange(TablePlacement.REPLICATED, 2) == pytest.approx(replicated, rel=0.2)  # once a step: the step's rows
    assert exchange(TablePlacement.ROW_SHARDED, 2) > 1.1 * sharded  # each pass's lookups: twice the calls
