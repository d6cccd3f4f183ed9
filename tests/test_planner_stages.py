"""The planner's stages (TorchRec's planner shape): an enumerator offers the model-wide settings,
a search fills each one's units, the cost model prices them; a caller swaps a stage, and the
prediction's typed parts survive the plan file."""

import json

import pytest
import torch.nn.functional as F

from hetero.planner.plan import Plan
from hetero.planner.config import PlannerConfig
from hetero.planner.planner import Planner
from hetero.planner.space import StateHome
from test_planner import MLP, _batch


def test_the_enumeration_and_the_search_are_stages_a_caller_swaps(cache):
    """TorchRec's planner shape: an enumerator offers the settings, a search fills each one's
    units; a swapped stage is used as given, and the planner prices what it returns."""
    from hetero.planner.search import brute_force
    from hetero.planner.space import CostPart, grid

    x, y = _batch()
    offered, searched = [], []

    def only_host_state(facts):
        got = [c for c in grid(facts) if c.state is StateHome.HOST and c.micro_batches == 1]
        offered.extend(got)
        return got

    def counting(cost, candidate, device, host):
        searched.append(candidate)
        return brute_force(cost, candidate, device, host)

    planner = Planner(MLP(), (x,), loss_fn=lambda o: F.cross_entropy(o, y), config=PlannerConfig(cache_dir=cache),
                      enumerator=only_host_state, search=counting)
    plan = planner.plan()
    assert offered and planner.settings == offered  # (nothing pinned: every offered setting kept)
    assert plan.candidate.state is StateHome.HOST and searched and set(searched) <= set(offered)
    default = Planner(MLP(), (x,), loss_fn=lambda o: F.cross_entropy(o, y), config=PlannerConfig(cache_dir=cache))
    assert len(default.settings) > len(offered)  # the default grid offers the other state homes too
    # the prediction's parts are typed, add up to the step, and survive the plan file
    assert all(isinstance(k, CostPart) for k in plan.predicted.parts)
    assert sum(plan.predicted.parts.values()) == pytest.approx(plan.predicted.seconds, rel=1e-6)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).predicted == plan.predicted
