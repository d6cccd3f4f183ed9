"""Sharding propagation against brute force over every layout of small graphs."""

import itertools

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from hetero.parallel.propagation import _ops, _report, candidates, layout_of_strategy, propagate


class Chain(nn.Module):
    """fc1 -> relu -> fc2 -> tanh -> (x @ w) -> add: six operators in a chain."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.w = nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        h = torch.tanh(self.fc2(torch.relu(self.fc1(x))))
        return torch.matmul(h, self.w) + 1.0


def _graph():
    gm = fx.symbolic_trace(Chain())
    ShapeProp(gm).propagate(torch.randn(64, 16))
    return gm


def _brute_force(gm, strategies, sizes):
    mesh_dims = [d for d, n in enumerate(sizes) if n > 1]
    ops = _ops(gm)
    by_node = {op.node: op for op in ops}
    choices = [[layout_of_strategy(op, strategies[op.node.name], sizes, mesh_dims)] if op.node.name in strategies
               else candidates(op, mesh_dims) for op in ops]
    best = None
    for combo in itertools.product(*choices):
        result = _report(ops, by_node, {op.node: c for op, c in zip(ops, combo)}, sizes, mesh_dims)
        if best is None or result.total_bytes < best.total_bytes:
            best = result
    return best, len(list(itertools.product(*choices)))


@pytest.mark.parametrize("sizes,annotated", [
    ((1, 1, 2), {"fc1": ((1, 1), (1, 2))}),          # tp 2: fc1 column-parallel
    ((1, 2, 2), {"fc1": ((2, 1), (1, 2))}),          # dp 2 x tp 2: rows on dp, columns on tp
    ((1, 2, 2), {"fc2": ((2, 2), (2, 1))}),          # the contraction of fc2 on tp
])
def test_one_annotated_op_gets_the_layouts_and_bytes_of_the_brute_force_optimum(sizes, annotated):
    gm = _graph()
    found = propagate(gm, annotated, sizes)
    best, searched = _brute_force(gm, annotated, sizes)
    assert searched > 50  # the brute force really searched (6 ops, several layouts each)
    assert found.total_bytes == pytest.approx(best.total_bytes)
    assert len(found.layouts) == 6
    fixed = next(iter(annotated))
    assert found.layouts[fixed] == best.layouts[fixed]  # the annotation is kept


def test_the_annotation_is_what_the_propagation_works_around():
    # fc1 column-parallel on tp: a cheaper layout of fc1 exists, but the annotation stands, and
    # the next operators follow its layout without moving data where they can.
    gm = _graph()
    found = propagate(gm, {"fc1": ((1, 1), (1, 2))}, (1, 1, 2))
    assert found.output_placements["fc1"] == (("R",), ("R",), ("S", 1))
    assert found.output_placements["relu"] == (("R",), ("R",), ("S", 1))  # elementwise: no move
    # fc2 takes fc1's cut as its contraction: row-parallel, no redistribution between them
    assert not any(m[0] in ("fc1", "relu") for m in found.redistributions)


def test_the_report_lists_layouts_and_every_redistribution_with_its_bytes():
    found = propagate(_graph(), {"fc1": ((2, 1), (1, 2))}, (1, 2, 2))
    text = str(found).splitlines()
    assert text[0] == "fc1: output [R, S(0), S(1)]"
    assert len([ln for ln in text if ln.startswith("redistribute ")]) == len(found.redistributions)
    assert text[-1] == f"per step: {found.total_bytes:.0f} B redistributed per rank"


def _run_under_layouts(tp, plan_args, all_to_all):
    from hetero.parallel.comm import CollectiveCounter
    from hetero.parallel.mesh import MeshConfig, build_mesh
    from hetero.parallel.operator_plan import ShardingPlan
    from hetero.parallel.sharding_graph import LayoutInterpreter, capture_for_sharding

    mesh = build_mesh(MeshConfig(tp=tp))
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    plan = ShardingPlan()
    for name, strategy in plan_args.items():
        plan.module(name, strategy)
    gm, strategies = capture_for_sharding(model, (x,), plan)
    predicted = propagate(gm, strategies, tuple(mesh.shape), all_to_all)
    with CollectiveCounter() as counter:
        out = LayoutInterpreter(gm, predicted, mesh).run(x)
    with torch.no_grad():
        want = model(x)
    kinds = ([c.value for move in predicted.redistributions for c in move[5]], [c.kind.value for c in counter.calls])
    return predicted.total_bytes, counter.total_bytes, kinds, (out.full_tensor() - want).abs().max().item()


@pytest.mark.parametrize("n,tp,plan,moves", [
    (2, 2, {"fc1": ((1, 1), (1, 2))}, True),   # column-parallel fc1: fc2 row-parallel, one all-reduce
    (2, 2, {"fc2": ((2, 1), (1, 1))}, False),  # rows everywhere: slices only, nothing to send
    (4, 2, {"fc1": ((2, 1), (1, 2))}, True),   # dp 2 x tp 2
    (4, 2, {"fc2": ((2, 2), (2, 1))}, True),   # the contraction of fc2 on tp, rows on dp
])
def test_a_run_under_the_propagated_layouts_sends_the_predicted_bytes(tmp_path, cpu_ranks, n, tp, plan, moves):
    from conftest import run_ranks

    predicted, counted, calls, err = run_ranks(tmp_path, n, _run_under_layouts, tp, plan, False)  # gloo: no all-to-all
    assert err < 1e-5  # the sharded graph computes the unsharded one
    assert (counted > 0) == moves, calls  # where the layouts move data, the counter sees it
    assert counted == pytest.approx(predicted), calls
    assert calls[0] == calls[1]  # the same collectives, in the same order


_TRANSITIONS = [  # (src, dst) over a dp 2 x tp 2 mesh; the pp dimension (size 1) replicates
    ((("R",), ("S", 0)), (("R",), ("R",))),
    ((("S", 0), ("S", 1)), (("R",), ("R",))),          # inner dimension gathered first: less moved
    ((("S", 0), ("S", 1)), (("R",), ("S", 1))),
    ((("R",), ("S", 0)), (("R",), ("S", 1))),          # gloo: all-gather + slice
    ((("S", 0), ("S", 1)), (("S", 1), ("S", 0))),      # two shard dimensions swap: gathered
    ((("P",), ("P",)), (("R",), ("R",))),
    ((("S", 0), ("P",)), (("R",), ("R",))),            # reduced while still cut, gathered after
    ((("P",), ("S", 1)), (("R",), ("R",))),            # inner gather first, then the outer all-reduce
    ((("R",), ("P",)), (("R",), ("S", 0))),            # reduce-scatter
]


def _redistribute_counted():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from hetero.parallel.comm import CollectiveCounter
    from hetero.parallel.mesh import MeshConfig, build_mesh

    mesh = build_mesh(MeshConfig(tp=2))
    place = {"R": Replicate(), "P": Partial()}
    out = []
    for src, dst in _TRANSITIONS:
        as_dt = [[Shard(p[1]) if p[0] == "S" else place[p[0]] for p in (("R",), *x)] for x in (src, dst)]
        x = torch.randn(8, 12)
        local = DTensor.from_local(x, mesh, [Replicate()] * 3, run_check=False).redistribute(
            mesh, [Replicate() if isinstance(p, Partial) else p for p in as_dt[0]]).to_local()
        d = DTensor.from_local(local, mesh, as_dt[0], run_check=False)
        with CollectiveCounter() as c:
            d.redistribute(mesh, as_dt[1]).to_local()
        out.append(c.total_bytes)
    return out


def test_the_cost_model_prices_each_redistribution_as_dtensor_runs_it(tmp_path, cpu_ranks):
    from conftest import run_ranks

    from hetero.parallel.propagation import edge_bytes

    counted = run_ranks(tmp_path, 4, _redistribute_counted)
    sizes = (1, 2, 2)
    predicted = [edge_bytes((("R",), *s), (("R",), *d), 8 * 12 * 4, sizes, all_to_all=False) for s, d in _TRANSITIONS]
    assert all(c > 0 for c in counted)
    assert counted == pytest.approx(predicted)


def test_explain_reports_layouts_collectives_and_parameter_bytes_per_rank():
    import hetero
    from hetero.parallel import MeshDim, ShardingPlan

    model = Chain()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = hetero.explain(model, (torch.randn(64, 16),), sharding=ShardingPlan().module("fc1", ((1, 1), (1, 2))),
                            mesh={MeshDim.TP: 2})
    text = str(report).splitlines()
    assert "operator sharding on mesh pp 1 x dp 1 x tp 2:" in text
    assert "  fc1: output [R, R, S(1)]" in text  # column-parallel, as annotated
    assert "  fc2: output [R, R, P]" in text  # propagated: row-parallel, partial sums
    assert "  redistribute fc2 -> tanh: [R, R, P] -> [R, R, S(0)] by reduce-scatter, 2048 B per rank" in text
    # fc1 weight and bias halved (column), fc2 weight halved (row), fc2 bias and w whole: 4 B each
    per_rank = 4 * ((32 * 16 + 32) // 2 + 16 * 32 // 2 + 16 + 16 * 8)
    assert text[-1] == f"  parameters: {per_rank} B per rank of {4 * (32 * 16 + 32 + 16 * 32 + 16 + 16 * 8)} B"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match=r"needs the mesh it plans for"):
        hetero.explain(model, (torch.randn(64, 16),), sharding=ShardingPlan().module("fc1", ((1, 1), (1, 2))))
    with pytest.raises(ValueError, match=r"names module 'fc3', which the forward of Chain does not call; the modules it "
                                         r"calls are \['fc1', 'fc2'\]"):
        hetero.explain(model, (torch.randn(64, 16),), sharding=ShardingPlan().module("fc3", ((1, 1), (1, 2))),
                       mesh={MeshDim.TP: 2})
