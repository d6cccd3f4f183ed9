"""The planner and the SSD tier: with ``PlannerConfig(ssd=...)`` a host budget below the tables puts
the coldest tables on the tier (priced by this disk's measured rates and the captured ids' expected
hit rate), a budget that fits keeps them in memory, and ``hetero.apply`` puts them there so that they
train exactly as the same model's tables in memory (the independent reference)."""

import numpy as np
import pytest
import torch

import hetero
from hetero.planner.apply import OptimizerConfig, apply
from hetero.planner.plan import Plan
from hetero.planner.config import PlannerConfig
from hetero.planner.planner import Planner
from hetero.planner.space import Candidate, Target, UnitChoice
from hetero.storage import SsdConfig

from test_planner_tables import _bce, _wide_deep


def test_a_host_budget_below_the_tables_puts_the_coldest_on_the_ssd_tier_and_apply_trains_them_exactly(cache, tmp_path):
    from hetero.embedding import host_tables
    from hetero.placement import StorageTier

    model, (features, dense), labels = _wide_deep()  # deep_a: 200k x 16 fp32 rows, 38 MB with LazyAdam's moments
    # a's ids skewed over its rows (Zipf(1.2)): a head seen again and again, a tail seen once (which the
    # Good-Turing estimate counts as rows never seen: misses)
    skewed = (np.random.default_rng(0).zipf(1.2, features["a"].shape) - 1) % 200_000
    inputs = ({**features, "a": torch.from_numpy(skewed).to(features["a"].dtype)}, dense)
    ssd = SsdConfig(tmp_path / "tier", cache_bytes=1 << 20)
    planner = Planner(model, inputs, loss_fn=lambda o: _bce(o, labels),
                      config=PlannerConfig(cache_dir=cache, device_tables=False, ssd=ssd))
    roomy = planner.plan()
    assert roomy.ssd_tables == ()  # the tier is slower: with host memory to spare the tables stay there
    budget = roomy.predicted.host_bytes - (30 << 20)
    plan = planner.plan(host_memory=budget)
    assert plan.ssd_tables == ("deep.tables.deep_a",), plan.ssd_tables  # the fewest ids per byte: given up first
    assert plan.units["deep"] == UnitChoice(Target.HOST, ssd_tables=1)
    # the same choice as the one typed value a table's placement is (TablePlan)
    placed = plan.table_plans(model)
    assert placed["deep.tables.deep_a"].memory is StorageTier.SSD and placed["deep.tables.deep_a"].ssd == ssd
    assert {n for n, p in placed.items() if p.memory is StorageTier.HOST_DRAM} == set(host_tables(model)) - {"deep.tables.deep_a"}
    assert plan.predicted.host_bytes <= budget and plan.predicted.seconds > roomy.predicted.seconds
    assert 0 < plan.ssd_hit_rate < 1
    text = str(hetero.explain(plan))
    assert f"tables on the SSD tier: deep.tables.deep_a ({ssd.directory}, a row cache of 1.0 MiB per group; " \
           f"expected row hit rate {plan.ssd_hit_rate:.0%})" in text, text
    again = Plan.from_dict(plan.to_dict())
    assert (again.ssd_tables, again.ssd, again.units) == (plan.ssd_tables, plan.ssd, plan.units)
    # hetero.apply puts the table there; it trains as the same plan with the table in memory, bit for
    # bit (priced as one process trains: the search may pick micro-batches or another state home on
    # another calibration, which sum in another order; beside the same plan, the device's dense part
    # sums alike on a GPU too)
    host = {"wide": UnitChoice(Target.HOST), "deep": UnitChoice(Target.HOST)}
    given = planner.price(Candidate(), {**host, "deep": UnitChoice(Target.HOST, ssd_tables=1)})
    assert given.ssd_tables == plan.ssd_tables and given.ssd == ssd
    reference, fresh = _wide_deep()[0], _wide_deep()[0]
    in_memory = apply(reference, planner.price(Candidate(), host), OptimizerConfig(lr=1e-2))
    applied = apply(fresh, given, OptimizerConfig(lr=1e-2))
    tables = host_tables(fresh)
    assert [n for n, t in tables.items() if t.config.storage is StorageTier.SSD] == ["deep.tables.deep_a"]
    assert tables["deep.tables.deep_a"].weight.is_meta  # (its host memory let go)
    for _ in range(3):
        assert in_memory.step(inputs, labels, _bce) == applied.step(inputs, labels, _bce)
    trained, ours = reference.state_dict(), fresh.state_dict()  # (the tier's rows read back)
    initial = _wide_deep()[0].state_dict()
    assert not torch.equal(trained["deep.tables.deep_a.weight"], initial["deep.tables.deep_a.weight"])  # it trained
    for name, p in trained.items():
        assert torch.equal(ours[name], p), name


def test_without_the_ssd_setting_the_planner_never_uses_the_tier(cache):
    model, inputs, labels = _wide_deep()
    planner = Planner(model, inputs, loss_fn=lambda o: _bce(o, labels),
                      config=PlannerConfig(cache_dir=cache, device_tables=False))
    assert all(not c.ssd_tables for i in range(len(planner.cost.units)) for c in planner.cost.options(i, Candidate()))
    with pytest.raises(ValueError, match="host budget"):
        planner.plan(host_memory=planner.plan().predicted.host_bytes - (30 << 20))


def test_hetero_train_with_table_storage_auto_puts_what_the_plan_chooses_on_the_tier(tmp_path, cache, monkeypatch,
                                                                                      capsys):
    # the Criteo job, 26 deep tables of 65,536 x 16 rows (327 MB with LazyAdam's moments): planned without
    # a host budget it keeps them in memory; with one 200 MB below that it puts tables on the tier, and
    # the job trains as the same job in memory
    from conftest import criteo_job, criteo_lines
    from hetero.cli import main
    from test_ssd_tier import load_whole

    monkeypatch.setenv("HETERO_CACHE", str(cache))  # the session's calibration (the CLI's cache directory)
    data = tmp_path / "c.tsv"
    data.write_text(criteo_lines(600, categories=3000))
    job = ["--config", str(criteo_job(tmp_path, 65536)), "--data-path", str(data), "--batch-size", "64",
           "--no-progress", "--cache-mb", "16", "--table-storage", "auto"]
    assert main(["plan", *job, "--out", str(tmp_path / "roomy.json")]) == 0
    roomy = Plan.load(tmp_path / "roomy.json")
    assert roomy.ssd_tables == ()
    budget = roomy.predicted.host_bytes - (200 << 20)
    assert main(["plan", *job, "--host-memory", str(budget), "--out", str(tmp_path / "plan.json")]) == 0
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.ssd_tables and all(n.startswith("deep.") for n in plan.ssd_tables), plan.ssd_tables
    assert plan.predicted.host_bytes <= budget
    assert main(["train", *job, "--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "auto")]) == 0
    assert len(list((tmp_path / "auto" / "ssd").iterdir())) >= 1
    assert main(["train", *job[:-2], "--run-dir", str(tmp_path / "mem")]) == 0
    a, b = load_whole(tmp_path / "mem" / "checkpoint.pt"), load_whole(tmp_path / "auto" / "checkpoint.pt")
    # (the plan may also put the dense optimizer's state on the host - HostAdamW, which rounds otherwise
    # than torch's Adam - so this compares to 1e-5; the tier itself is bit for bit, above and in test_ssd_tier)
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    # scored from the tier's snapshots (those tables) and the checkpoint file (the others), as in memory
    import pyarrow.parquet as pq

    for name in ("mem", "auto"):
        assert main(["predict", "--checkpoint", str(tmp_path / name / "checkpoint.pt"), "--data", str(data), "--out",
                     str(tmp_path / f"{name}.parquet")]) == 0
    scores = [pq.read_table(tmp_path / f"{n}.parquet").column("score").to_numpy() for n in ("mem", "auto")]
    np.testing.assert_allclose(scores[1], scores[0], rtol=0, atol=1e-5)
    capsys.readouterr()
    assert main(["train", *job, "--run-dir", str(tmp_path / "unplanned")]) == 1
    assert "tables.storage = auto (--table-storage auto) lets the planner choose: add --plan auto" in \
        capsys.readouterr().err
