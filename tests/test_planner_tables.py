"""The planner and host tables: a table is placed on the device only where it fits the budget,
and tables a plan moves there train as the unplaced model's host tables do."""

import torch
import torch.nn.functional as F

from hetero.placement import Target
from hetero.planner import calibration as calibration_module
from hetero.planner.apply import OptimizerConfig, apply
from hetero.planner.config import PlannerConfig
from hetero.planner.meter import measure_step
from hetero.planner.plan import Plan
from hetero.planner.planner import Planner
from hetero.planner.space import Candidate, UnitChoice

from conftest import make_dataset


def _wide_deep(rows_a=200_000):
    from hetero.models.wide_deep import FeatureSlot, WideDeep

    data = make_dataset(256)
    torch.manual_seed(0)
    model = WideDeep([FeatureSlot("a", rows_a), FeatureSlot("b", 30)], 3)  # a's deep table: 200k x 16 x 4 B
    b = next(iter(data.batches(256)))
    return model, ({"a": b.features["a"], "b": b.features["b"]}, b.dense), b.label


def _bce(logits, labels):
    return F.binary_cross_entropy_with_logits(logits, labels)


def free_device_tables(planner):
    """A device whose tables cost nothing, and host tables whose cost is each table's own: every
    table that fits is worth moving, by far more than the search's tie-break (a tolerance of the
    unit's host work). The host's rates are set, not calibrated: a fit on a loaded machine (the
    suite's other worker) may put a group's work in its fixed term, and moving one table of two
    then saved less than the tie-break (CI: 2026-12-01)."""
    free = calibration_module.TableRate(*[0.0] * 9)
    per_table = calibration_module.TableRate(0.0, 1e-4, 1e-8, 0.0, 0.0, 1e-4, 1e-8, 0.0, 0.0)
    planner.calibration.device_tables = {k: free for k in planner.calibration.device_tables}
    planner.calibration.tables = {k: per_table for k in planner.calibration.tables}


def test_a_table_larger_than_the_device_budget_is_never_placed_on_the_device(cache):
    model, inputs, labels = _wide_deep()
    planner = Planner(model, inputs, loss_fn=lambda o: _bce(o, labels), config=PlannerConfig(cache_dir=cache))
    free_device_tables(planner)
    unlimited = planner.plan()
    assert set(unlimited.device_tables) == {"wide.tables.wide_a", "wide.tables.wide_b", "deep.tables.deep_a",
                                            "deep.tables.deep_b"}
    assert unlimited.units["deep"] == UnitChoice(Target.DEVICE, device_tables=2)
    budget = 2 << 20  # 2 MiB: less than either of a's tables (12.8 MB; 0.8 MB + LazyAdam's 1.6 MB)
    plan = planner.plan(device_memory=budget)
    assert set(plan.device_tables) == {"wide.tables.wide_b", "deep.tables.deep_b"}, plan.device_tables
    assert plan.units["deep"] == UnitChoice(Target.HOST, device_tables=1) and "1 table(s) on the device" in str(plan)
    assert plan.predicted.device_bytes <= budget and plan.predicted.host_bytes > 12_800_000
    measured = measure_step(apply(_wide_deep()[0], plan), inputs, labels, _bce, steps=1, warmup=1)
    assert measured.device_bytes <= budget
    assert Plan.from_dict(plan.to_dict()).device_tables == plan.device_tables
    # the main job keeps its tables on the host: its planner never moves one
    host_only = Planner(model, inputs, loss_fn=lambda o: _bce(o, labels),
                        config=PlannerConfig(cache_dir=cache, device_tables=False))
    assert host_only.plan().device_tables == ()


def train_beside(applied, reference, inputs, labels, steps=3):
    """``steps`` steps of an applied plan and, beside it, of the unplaced ``reference`` model with
    torch's AdamW and hetero's LazyAdam at the same learning rates (the independent reference)."""
    from hetero.embedding import dense_parameters, host_tables
    from hetero.optim import LazyAdam, LazyAdamConfig

    dense = torch.optim.AdamW(dense_parameters(reference), lr=1e-2, weight_decay=0.0)
    sparse = LazyAdam(host_tables(reference), LazyAdamConfig())
    for _ in range(steps):
        applied.step(inputs, labels, _bce)
        for opt in (dense, sparse):
            opt.zero_grad()
        _bce(reference(*inputs), labels).backward()
        dense.step()
        sparse.step()


def test_tables_a_plan_moves_to_the_device_train_as_host_tables_do(cache):
    from hetero.embedding import DeviceEmbedding, host_tables

    model, inputs, labels = _wide_deep(rows_a=500)
    reference = _wide_deep(rows_a=500)[0]
    planner = Planner(model, inputs, loss_fn=lambda o: _bce(o, labels), config=PlannerConfig(cache_dir=cache))
    units = {"wide": UnitChoice(Target.HOST, device_tables=1), "deep": UnitChoice(Target.DEVICE, device_tables=2)}
    plan = planner.price(Candidate(), units)
    assert len(plan.device_tables) == 3
    applied = apply(model, plan, OptimizerConfig(lr=1e-2))
    assert sum(isinstance(m, DeviceEmbedding) for m in model.modules()) == 3 and len(host_tables(model)) == 1
    train_beside(applied, reference, inputs, labels)
    trained, initial = dict(model.named_parameters()), dict(_wide_deep(rows_a=500)[0].named_parameters())
    for name, p in reference.named_parameters():
        assert (p != initial[name]).any(), name  # it trained (a device table left alone would not)
        # (a device table's sums run in another order: Adam normalises a near-zero gradient's rounding)
        torch.testing.assert_close(trained[name].detach().cpu(), p.detach(), rtol=0, atol=2e-5, msg=name)
