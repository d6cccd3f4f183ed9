"""Recompute: the gradients of the plain model under every policy, less activation memory
(measured from the allocator), composed with host placement and operator-parallel layers."""

import pytest
import torch
from conftest import load_example

from hetero.optim.accounting import measure_allocations
from hetero.parallel.recompute import RecomputeConfig, RecomputeOp, apply_recompute
from hetero.placement import PlacementSpec, partition


LM = load_example("lm_host_adam")
BLOCKS = ("blocks.0", "blocks.1", "blocks.2")


def _model():
    torch.manual_seed(0)
    return LM.Decoder(64, 64, 3, 4, 32)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (8, 32), generator=g), torch.randint(0, 64, (8, 32), generator=g)


def _grads_and_held_bytes(model):
    x, y = _batch()
    keep = []
    held = measure_allocations(lambda: keep.append(LM.lm_loss(model(x), y))).net  # what forward keeps for backward
    keep[0].backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}, held


POLICIES = {"full": frozenset(), "matmul": frozenset({RecomputeOp.MATMUL}),
            "attention": frozenset({RecomputeOp.ATTENTION}),
            "matmul+attention": frozenset({RecomputeOp.MATMUL, RecomputeOp.ATTENTION})}


def _policies():
    want, plain = _grads_and_held_bytes(_model())
    held, errors = {}, {}
    for name, save in POLICIES.items():
        model = _model()
        apply_recompute(model, RecomputeConfig(BLOCKS, save))
        grads, held[name] = _grads_and_held_bytes(model)
        errors[name] = max((grads[k] - want[k]).abs().max().item() for k in want)
    return plain, held, errors


def test_every_policy_gives_the_plain_gradients_and_keeps_less(tmp_path):
    from conftest import run_ranks

    plain, held, errors = run_ranks(tmp_path, 1, _policies)  # a fresh process: the allocator's events are this test's
    assert all(e <= 1e-6 for e in errors.values()), errors
    # full keeps the blocks' inputs only; keeping matmul outputs keeps more, yet less than nothing recomputed
    assert held["full"] < held["attention"] < held["matmul"] < held["matmul+attention"] < plain, (held, plain)
    assert held["full"] < 0.5 * plain


def test_recompute_inside_a_host_placed_partition_keeps_the_region_and_the_gradients():
    want, _ = _grads_and_held_bytes(_model())
    model = _model()
    apply_recompute(model, RecomputeConfig(("blocks.0",)))
    hm = partition(model, PlacementSpec().module("blocks.1.fc", "host"))
    called = {str(n.target) for sub in hm.split.children() for n in sub.graph.nodes if n.op == "call_module"}
    assert "blocks_0" in called  # one region: traced through, the checkpoint would be lost
    x, y = _batch()
    out = hm(x)  # (on the device: a GPU's, beside the host-placed part)
    LM.lm_loss(out, y.to(out.device)).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), want[k].cpu(), rtol=0, atol=1e-6, msg=k)


def test_bad_recompute_policies_name_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"recompute policy names module 'blocks.7', which Decoder does not have; its "
                                         r"modules are \['blocks', 'blocks.0', "):
        apply_recompute(_model(), RecomputeConfig(("blocks.7",)))
    with pytest.raises(ValueError, match=r"recompute policy: no operator type 'conv'; valid: \['attention', 'matmul'\]"):
        RecomputeConfig.parse_ops(["matmul", "conv"])
    with pytest.raises(ValueError, match=r"recompute policy names 'blocks.0.fc' inside 'blocks.0'; name one of them"):
        apply_recompute(_model(), RecomputeConfig(("blocks.0", "blocks.0.fc")))
