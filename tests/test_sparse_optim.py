"""Sparse optimizers against per-coordinate references of their published rules, and torch's."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from hetero.embedding import HostEmbedding, Pooling, TableConfig
from hetero.optim import FTRL, SGD, Adagrad, AdagradConfig, FTRLConfig, LazyAdam, LazyAdamConfig, SGDConfig

VOCAB, DIM, STEPS = 12, 3, 6


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB // 2, (7,), generator=g)  # rows >= VOCAB // 2 are never touched
        ids[:3] = ids[0]  # duplicates in every batch
        out.append((ids, torch.randn(7, DIM, generator=g)))
    return out


def _coalesced(ids, upstream):
    grads = {}
    for i, row in zip(ids.tolist(), upstream.double().numpy()):
        grads[i] = grads.get(i, 0.0) + row
    return grads


def _run_hetero(opt_cls, config, init_std=0.5):
    torch.manual_seed(0)
    table = HostEmbedding(TableConfig("t", VOCAB, DIM, init_std=init_std))
    w0 = table.weight.detach().double().numpy().copy()
    opt = opt_cls([table], config)
    for ids, upstream in _batches():
        opt.zero_grad()
        (table(ids) * upstream).sum().backward()
        opt.step()
    return w0, table, opt


def _reference(w0, step_fn, state):
    w = w0.copy()
    for t, (ids, upstream) in enumerate(_batches(), start=1):
        for i, g in _coalesced(ids, upstream).items():
            for j in range(DIM):
                w[i, j] = step_fn(w[i, j], g[j], state, (i, j), t)
    return w


def lazy_adam_ref(c):
    def step(w, g, s, k, t):
        m = c.beta1 * s.get(("m", k), 0.0) + (1 - c.beta1) * g
        v = c.beta2 * s.get(("v", k), 0.0) + (1 - c.beta2) * g * g
        s[("m", k)], s[("v", k)] = m, v
        return w - c.lr * math.sqrt(1 - c.beta2**t) / (1 - c.beta1**t) * m / (math.sqrt(v) + c.eps)

    return step


def ftrl_ref(c):
    # McMahan et al. 2013, Algorithm 1, per coordinate.
    def step(w, g, s, k, t):
        n, z = s.get(("n", k), c.initial_accumulator), s.get(("z", k), 0.0)
        sigma = (math.sqrt(n + g * g) - math.sqrt(n)) / c.lr
        z += g - sigma * w
        n += g * g
        s[("n", k)], s[("z", k)] = n, z
        if abs(z) <= c.l1:
            return 0.0
        return -(z - math.copysign(c.l1, z)) / ((c.beta + math.sqrt(n)) / c.lr + c.l2)

    return step


def adagrad_ref(c):
    def step(w, g, s, k, t):
        s[k] = s.get(k, c.initial_accumulator) + g * g
        return w - c.lr * g / (math.sqrt(s[k]) + c.eps)

    return step


def sgd_ref(c):
    return lambda w, g, s, k, t: w - c.lr * g


CASES = [
    (LazyAdam, LazyAdamConfig(lr=0.05), lazy_adam_ref),
    (FTRL, FTRLConfig(lr=0.1, l1=0.5, l2=0.2, beta=1.0, initial_accumulator=0.1), ftrl_ref),
    (FTRL, FTRLConfig(lr=0.1, l1=0.0, l2=0.0, beta=0.5), ftrl_ref),
    (Adagrad, AdagradConfig(lr=0.1, initial_accumulator=0.1), adagrad_ref),
    (SGD, SGDConfig(lr=0.1), sgd_ref),
]


@pytest.mark.parametrize("opt_cls,config,ref", CASES, ids=lambda x: getattr(x, "__name__", ""))
def test_equals_published_update_rule(opt_cls, config, ref):
    w0, table, _ = _run_hetero(opt_cls, config)
    expected = _reference(w0, ref(config), {})
    np.testing.assert_allclose(table.weight.double().numpy(), expected, rtol=1e-5, atol=1e-6)


def test_lazy_adam_leaves_untouched_rows_and_their_state_alone():
    torch.manual_seed(0)
    table = HostEmbedding(TableConfig("t", VOCAB, DIM, init_std=0.5))
    opt = LazyAdam([table], LazyAdamConfig(lr=0.05))
    (table(torch.tensor([0, 1])) * 1.0).sum().backward()
    opt.step()
    w_before = table.weight.detach().clone()
    m_before, v_before = opt.table_state["t"]["exp_avg"].clone(), opt.table_state["t"]["exp_avg_sq"].clone()
    table(torch.tensor([1, 2])).sum().backward()  # row 0 has state now but is not in this batch
    opt.step()
    for rows in ([0], list(range(3, VOCAB))):
        assert torch.equal(table.weight[rows], w_before[rows])
        assert torch.equal(opt.table_state["t"]["exp_avg"][rows], m_before[rows])
        assert torch.equal(opt.table_state["t"]["exp_avg_sq"][rows], v_before[rows])
    assert not torch.equal(table.weight[[1, 2]], w_before[[1, 2]])


@pytest.mark.parametrize(
    "opt_cls,config,torch_opt",
    [
        (LazyAdam, LazyAdamConfig(lr=0.05), lambda p: torch.optim.SparseAdam(p, lr=0.05)),
        (Adagrad, AdagradConfig(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
        (SGD, SGDConfig(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    ],
    ids=["lazy_adam~SparseAdam", "adagrad~Adagrad", "sgd~SGD"],
)
def test_matches_torch_sparse_optimizers(opt_cls, config, torch_opt):
    w0, table, _ = _run_hetero(opt_cls, config)
    ref = nn.Embedding(VOCAB, DIM, sparse=True)
    ref.weight.data.copy_(torch.from_numpy(w0).float())
    opt = torch_opt(ref.parameters())
    for ids, upstream in _batches():
        opt.zero_grad()
        (ref(ids) * upstream).sum().backward()
        opt.step()
    torch.testing.assert_close(table.weight.detach(), ref.weight.detach(), rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_and_mismatch_errors():
    _, table, opt = _run_hetero(LazyAdam, LazyAdamConfig(lr=0.05))
    fresh = LazyAdam([table])
    fresh.load_state_dict(opt.state_dict())
    assert fresh.steps == opt.steps and fresh.state_dict()["config"] == opt.state_dict()["config"]
    assert fresh.hyper["lr"] == 0.05
    assert torch.equal(fresh.table_state["t"]["exp_avg_sq"], opt.table_state["t"]["exp_avg_sq"])
    with pytest.raises(ValueError, match="sparse optimizer state is for LazyAdam, not Adagrad"):
        Adagrad([table]).load_state_dict(opt.state_dict())
    other = LazyAdam([HostEmbedding(TableConfig("t", VOCAB + 1, DIM))])
    with pytest.raises(ValueError, match=r"state 'exp_avg' of table 't' has shape \(12, 3\) in the checkpoint and \(13, 3\) here"):
        other.load_state_dict(opt.state_dict())


def test_empty_batch_is_a_no_op():
    torch.manual_seed(0)
    table = HostEmbedding(TableConfig("t", VOCAB, DIM, pooling=Pooling.SUM))
    opt = LazyAdam([table])
    w = table.weight.detach().clone()
    table(torch.tensor([], dtype=torch.int64), torch.tensor([0, 0])).sum().backward()
    opt.step()
    assert torch.equal(table.weight, w) and opt.steps["t"] == 0


def test_an_lr_schedule_acts_on_a_sparse_optimizer_as_on_torch_sgd():
    # torch's StepLR on hetero's SGD equals torch's StepLR on torch's SGD over a dense copy of the table.
    torch.manual_seed(0)
    table = HostEmbedding(TableConfig("t", VOCAB, DIM, init_std=1.0))
    ref = nn.Parameter(table.weight.detach().clone())
    opt = SGD([table], SGDConfig(lr=0.5))
    ref_opt = torch.optim.SGD([ref], lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = torch.randint(0, VOCAB, (7,), generator=g)
        opt.zero_grad()
        ref_opt.zero_grad()
        table(ids).square().sum().backward()
        nn.functional.embedding(ids, ref).square().sum().backward()
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    assert opt.hyper["lr"] == pytest.approx(0.5 * 0.1**2)
    torch.testing.assert_close(table.weight, ref.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("lr", [-0.1, float("nan"), float("inf")])
def test_a_negative_or_non_finite_learning_rate_is_refused(lr):
    table = HostEmbedding(TableConfig("t", VOCAB, DIM))
    with pytest.raises(ValueError, match=r"LazyAdam: learning rate must be a finite number >= 0, got"):
        LazyAdam([table], LazyAdamConfig(lr=lr))
    opt = LazyAdam([table])
    before = table.weight.detach().clone()
    table(torch.tensor([1, 2])).sum().backward()
    opt.hyper["lr"] = lr  # what a broken schedule would set
    with pytest.raises(ValueError, match="learning rate must be a finite number >= 0"):
        opt.step()
    assert torch.equal(table.weight, before)
