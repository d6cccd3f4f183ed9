"""The planner's device peak on CUDA counts what a kernel takes beside its tensors: a reduction's
scratch buffer (found on an H200, GPU run 12), priced from the calibration's measured table."""

import dataclasses
import json

import torch.nn.functional as F

from hetero.placement import Target
from hetero.planner import calibration as calibration_module
from hetero.planner.config import PlannerConfig
from hetero.planner.cost import MeasuredCost
from hetero.planner.planner import Planner
from hetero.planner.space import Candidate, OptimizerKind, UnitChoice

from test_planner import MLP, _batch


def test_a_device_units_backward_holds_its_reductions_scratch_as_calibrated(cache):
    """CUDA's reductions take a scratch buffer beyond their output (2 MiB for a (2048, 256) bias
    gradient on an H200): a device unit's backward peak adds the calibrated scratch of summing its
    output, the smallest measured size at least as large, in proportion beyond; host units none."""
    x, y = _batch(2048)
    planner = Planner(MLP(), (x,), loss_fn=lambda o: F.cross_entropy(o, y), config=PlannerConfig(cache_dir=cache))
    cal = planner.cost.cal
    points = ((1 << 20, 3 << 20), (4 << 20, 5 << 20))  # (bytes reduced, scratch): a made-up device
    base, scratched = (MeasuredCost(planner.cost.graph, dataclasses.replace(cal, op_scratch=p), OptimizerKind.ADAMW)
                       for p in ((), points))
    assert calibration_module.Calibration.from_json(json.loads(json.dumps(scratched.cal.to_json()))).op_scratch == points
    for i, name in enumerate(base.names()):
        output = base.units[i].output_bytes  # (the whole batch in one pass)
        want = 3 << 20 if output <= 1 << 20 else 5 << 20 if output <= 4 << 20 else (5 << 20) * output // (4 << 20)
        device = scratched.unit(i, UnitChoice(), Candidate()).device_during - base.unit(i, UnitChoice(), Candidate()).device_during
        host = scratched.unit(i, UnitChoice(target=Target.HOST), Candidate()).device_during
        assert (device, host) == (want, 0), name
