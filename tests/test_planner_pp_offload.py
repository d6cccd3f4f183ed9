"""The planner's offloaded optimizer state inside pipeline stages: a pp plan whose stages keep
AdamW's state on the host (HostAdamW, all of it; PartialOffloadAdamW, a ratio) trains as torch's
AdamW in one process, holds no moments on the device (measured), and over ``dp`` replicas
HostAdamW averages the replicas' gradients of its part itself (torch's replicate the rest's)."""

import pytest
import torch
import torch.nn.functional as F
from test_planner_pp import Stack, _batches

from hetero.placement import PlacementSpec, Target
from hetero.planner.pipeline import priced_stages
from hetero.planner.plan import Plan
from hetero.planner.config import PlannerConfig
from hetero.planner.planner import Planner
from hetero.planner.space import Candidate, OptimizerKind, StateHome

WIDTH, LR, DECAY = 256, 1e-2, 0.01


def _model():
    return Stack(width=WIDTH)


def _train(paths):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hetero.planner.apply import OptimizerConfig, apply
    from hetero.planner.meter import measure_step

    x, y = _batches(1)[0]
    out = []
    for path in paths:
        torch.manual_seed(0)
        run = apply(_model(), Plan.load(path), OptimizerConfig(lr=LR, weight_decay=DECAY), loss_fn=F.cross_entropy)
        # 1 warm-up, 1 timed and 2 metered steps on the batch: the device's live bytes of the metered ones
        measured = measure_step(run, (x,), y, F.cross_entropy, steps=1, warmup=1)
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()  # (replicate's are DTensors)
                  for n, p in run.model.named_parameters()}
        out.append((type(run.optimizers.dense).__name__, measured.device_bytes, params))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)
    return every


def _reference(steps=4):
    """torch's AdamW in one process, ``steps`` steps on the batch."""
    x, y = _batches(1)[0]
    torch.manual_seed(0)
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=DECAY)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    return {n: p.detach() for n, p in ref.named_parameters()}


def _planner(cache, world_size):
    """Every unit pinned to the device (the search keeps it): the plans differ in their state only."""
    x, y = _batches(1)[0]
    pinned = PlacementSpec()
    for name in ["inp", *(f"blocks.{i}" for i in range(4)), "head"]:
        pinned.module(name, Target.DEVICE)
    return Planner(_model(), (x,), world_size=world_size, loss_fn=lambda o: F.cross_entropy(o, y),
                   optimizer=OptimizerKind.ADAMW, placement=pinned, config=PlannerConfig(cache_dir=cache))


def _assert_trained_as_one_process(ranks, want, atol=1e-3):
    """Every rank's stage equals the one-process reference (Adam moves a near-zero gradient's
    element by up to lr on a rounding difference: atol 1e-3 at lr 1e-2; a skipped update is off by
    more)."""
    got: dict[str, torch.Tensor] = {}
    for params in ranks:
        for name, p in params.items():
            if name in got:  # a stage's replicas stay equal
                assert torch.equal(got[name], p), name
            got[name] = p
    assert set(got) == set(want)
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def test_a_stage_keeps_its_adamw_state_on_the_host_and_trains_as_one_process(tmp_path, cpu_ranks, cache):
    from conftest import run_ranks

    planner = _planner(cache, 2)
    states = [Candidate(pp=2, micro_batches=2), Candidate(pp=2, micro_batches=2, state=StateHome.HOST, offload_ratio=1.0),
              Candidate(pp=2, micro_batches=2, state=StateHome.PARTIAL, offload_ratio=0.5)]
    assert all(c in planner.settings for c in states)
    plans = [planner.price(c) for c in states]
    assert all(not p.host_units() for p in plans)
    # the stages' moments leave the device for the host: priced at the device-state plan's split, and at
    # each plan's own where it is the same - a plan's split is a measured choice (a GPU's, or a loaded
    # machine's, cuts the offloaded plans elsewhere: other blocks per stage, whose largest is not comparable)
    base = planner._stages(states[0], float("inf"), float("inf"))
    assert base.device_bytes == plans[0].predicted.device_bytes
    for c, p in zip(states[1:], plans[1:], strict=True):
        at = priced_stages(planner.cost, c, base.cuts, base.choices, planner._transfer(c), planner._reduce(c))
        assert at.device_bytes < base.device_bytes, c
        if p.split_points == plans[0].split_points:
            assert p.predicted.device_bytes < plans[0].predicted.device_bytes, c
    assert plans[1].predicted.host_bytes > plans[2].predicted.host_bytes > plans[0].predicted.host_bytes
    gathered = run_ranks(tmp_path, 2, _train, [str(p.save(tmp_path / f"plan{i}.json")) for i, p in enumerate(plans)])
    want = _reference()
    for k, (plan, name) in enumerate(zip(plans, ["AdamW", "HostAdamW", "PartialOffloadAdamW"], strict=True)):
        ranks = [rank[k] for rank in gathered]
        assert {kind for kind, _, _ in ranks} == {name}
        _assert_trained_as_one_process([params for _, _, params in ranks], want)
        peak = max(nbytes for _, nbytes, _ in ranks)
        assert 0.8 * peak <= plan.predicted.device_bytes and peak <= plan.predicted.device_bytes * 1.05, (name, peak)
        sizes = [(nbytes, sum(p.numel() for p in params.values())) for _, nbytes, params in ranks]
        assert max(elements for _, elements in sizes) >= 2**17  # (the split is the cost model's: one stage holds blocks)
        for nbytes, elements in sizes:  # measured: a stage's parameters, gradients and (on the device) moments
            if elements < 2**17:
                continue  # a stage of the head alone: its micro-batches' activations weigh as much
            if plan.candidate.state is StateHome.DEVICE:
                assert nbytes >= 0.95 * 16 * elements, (nbytes, elements)
            elif plan.candidate.state is StateHome.HOST:  # weights and their micro-batches' gradient sum only
                assert 0.95 * 8 * elements <= nbytes < 12 * elements, (nbytes, elements)


@pytest.mark.parametrize("state,ratio,kind", [(StateHome.HOST, 1.0, "HostAdamW"),
                                              (StateHome.PARTIAL, 0.5, "PartialOffloadAdamW")])
def test_a_stages_replicas_average_their_gradients_in_host_adamw(tmp_path, cpu_ranks, cache, state, ratio, kind):
    """All of a stage's state on the host: HostAdamW averages the replicas' gradients itself. Half
    of it: HostAdamW that half's, torch's replicate the rest (leaving the host part's out)."""
    from conftest import run_ranks

    planner = _planner(cache, 4)
    c = Candidate(pp=2, dp=2, micro_batches=2, state=state, offload_ratio=ratio)
    assert c in planner.settings
    gathered = run_ranks(tmp_path, 4, _train, [str(planner.price(c).save(tmp_path / "plan.json"))])
    ranks = [rank[0] for rank in gathered]
    assert {k for k, _, _ in ranks} == {kind}
    _assert_trained_as_one_process([params for _, _, params in ranks], _reference())


def test_branch_and_bound_plans_as_searching_every_setting(cache, monkeypatch):
    """The settings whose unbudgeted bound loses are not searched; the plan and every decision's
    runner-up are those of searching them all (here: pipelines with offloaded state among 2 ranks'
    settings, the Stack's units free)."""
    x, y = _batches(1)[0]
    planner = Planner(_model(), (x,), world_size=2, loss_fn=lambda o: F.cross_entropy(o, y),
                      optimizer=OptimizerKind.ADAMW, config=PlannerConfig(cache_dir=cache))
    everything = planner.price(Candidate()).predicted.device_bytes
    budgets = [None, int(everything * 0.35), int(everything * 0.1)]
    for c in planner.settings:  # a lower bound: below any of the setting's assignments (here: the priced one)
        assert planner._bound(c) <= planner.price(c).predicted.seconds * (1 + 1e-9), c
    pruned = [planner.plan(device_memory=b) for b in budgets]
    assert sum(p.search.searched < p.search.candidates for p in pruned) >= 2  # the bound skipped settings
    monkeypatch.setattr(Planner, "_bound", lambda self, c: 0.0)  # every setting searched
    for budget, plan in zip(budgets, pruned, strict=True):
        every = planner.plan(device_memory=budget)
        assert every.search.searched == every.search.candidates
        assert (plan.candidate, plan.units, plan.split_points) == (every.candidate, every.units, every.split_points)
        assert plan.predicted.seconds == pytest.approx(every.predicted.seconds, rel=1e-12)
        assert [(d.what, d.chosen, d.runner_up, d.runner_up_seconds) for d in plan.decisions] == \
            [(d.what, d.chosen, d.runner_up, d.runner_up_seconds) for d in every.decisions], budget
