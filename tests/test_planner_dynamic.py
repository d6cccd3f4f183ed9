"""The planner and dynamic tables (hetero.dynamic): a dynamic table stays on the host, and a plan's
host bytes count its key map, measured (tracemalloc) against the same model with fixed tables."""

import tracemalloc

from hetero.dynamic import DynamicConfig, KeyMap
from hetero.planner.config import PlannerConfig
from hetero.planner.planner import Planner
from hetero.planner.space import Candidate

from test_planner_tables import _bce, _wide_deep, free_device_tables

ROWS_A = 200_000
CONFIG = DynamicConfig(admit_after=2, sketch_width=1 << 14)


def _dynamic_wide_deep():
    import torch

    from hetero.models.wide_deep import FeatureSlot, WideDeep

    _, inputs, labels = _wide_deep(ROWS_A)
    torch.manual_seed(0)  # a's tables dynamic (the batch's ids are its keys), b's fixed
    model = WideDeep([FeatureSlot("a", ROWS_A, dynamic=CONFIG), FeatureSlot("b", 30)], 3)
    return model, inputs, labels


def test_dynamic_tables_stay_on_the_host_and_their_key_maps_count_in_host_bytes(cache):
    fixed, inputs, labels = _wide_deep(ROWS_A)
    dynamic, _, _ = _dynamic_wide_deep()
    planners = [Planner(m, inputs, loss_fn=lambda o: _bce(o, labels), config=PlannerConfig(cache_dir=cache))
                for m in (fixed, dynamic)]
    # the key maps of a's two tables (wide and deep), as built, measured apart (their Python objects: a few KB)
    tracemalloc.start()
    maps = [KeyMap("wide_a", ROWS_A, CONFIG), KeyMap("deep_a", ROWS_A, CONFIG)]
    measured = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    default_rows = (1 + 2) * 4 * (1 + 16)  # a's two default rows, fp32 with LazyAdam's two moments (wide: FTRL's two)
    host = [p.price(Candidate()).predicted.host_bytes for p in planners]
    assert abs(host[1] - host[0] - measured - default_rows) < 4096, (host, measured, [m.nbytes for m in maps])
    # a device whose tables cost nothing: every fixed table that fits moves, no dynamic one
    for p in planners:
        free_device_tables(p)
    assert "deep.tables.deep_a" in planners[0].plan().device_tables
    # (whether b's tables move, each saving its 0.1 ms, is up to a measured term of the step that moves by more on
    # a busy host: 1 run in 3 kept them on the host, in the tree before 2026-12-07 too; a's never move)
    dynamic_plan = planners[1].plan()
    assert set(dynamic_plan.device_tables) <= {"wide.tables.wide_b", "deep.tables.deep_b"}, str(dynamic_plan)
    assert dynamic_plan.device_tables or "1 table(s) on the device" in str(dynamic_plan)  # (b's were priced there)
