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
        result = _report(ops, by_node, {op.node: c for op, c in zip(ops, combo)}, sizes, mesh_dims, 4)
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
