"""ZeRO stages 1-3 for device optimizers: N data-parallel ranks equal one process, and each
rank keeps about 1/N of the optimizer state (counted from the live state tensors)."""

import warnings

import pytest
import torch

from conftest import load_example, run_ranks

from hetero.optim.accounting import storage_bytes
from hetero.parallel.mesh import MeshConfig, build_mesh
from hetero.parallel.zero import ZeroConfig, ZeroStage, apply_zero, zero_optimizer

STEPS, BATCH = 20, 8


def _lm():
    return load_example("lm_host_adam")


def _model(lm):
    torch.manual_seed(0)
    return lm.Decoder(64, 32, 2, 4, 16)


def _batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 64, (BATCH, 16), generator=g), torch.randint(0, 64, (BATCH, 16), generator=g))
            for _ in range(STEPS)]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _reference():
    lm = _lm()
    model = _model(lm)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for x, y in _batches():
        opt.zero_grad()
        lm.lm_loss(model(x), y).backward()
        opt.step()
    state = [t for st in opt.state.values() for t in st.values() if t.dim() > 0]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, storage_bytes(state)


def _zero(stage):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    lm = _lm()
    mesh = build_mesh(MeshConfig())  # every rank data-parallel
    n, r = dist.get_world_size(), dist.get_rank()
    config = ZeroConfig(stage, units=("blocks.0", "blocks.1"))
    model = apply_zero(_model(lm), config, mesh)
    net = DistributedDataParallel(model, process_group=mesh["dp"].get_group()) if stage < 2 else model
    opt = zero_optimizer(model.parameters(), torch.optim.AdamW, config, mesh, lr=3e-3, weight_decay=0.1)
    share = BATCH // n
    for x, y in _batches():
        opt.zero_grad()
        lm.lm_loss(net(x[r * share:(r + 1) * share]), y[r * share:(r + 1) * share]).backward()  # mean of equal shares
        opt.step()
    inner = opt.optim if stage == 1 else opt
    state = [t for st in inner.state.values() for t in st.values() if t.dim() > 0]
    sharded = sorted(k for k, p in model.named_parameters() if hasattr(p, "full_tensor"))
    return {k: _full(v).detach().clone() for k, v in model.state_dict().items()}, storage_bytes(state), sharded


@pytest.mark.parametrize("n,stage", [(2, 1), (2, 2), (2, 3), (4, 1), (4, 3)])
def test_every_zero_stage_trains_as_one_process_and_shards_the_state(tmp_path, cpu_ranks, n, stage):
    want, whole = _reference()
    state, per_rank, sharded = run_ranks(tmp_path, n, _zero, stage)
    for k, v in want.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5, msg=k)
    assert per_rank < whole / n * 1.25  # each rank's moments: about 1/n (partitions are not exactly even)
    assert bool(sharded) == (stage >= 2)  # stages 2, 3: the parameters themselves are shards between uses


def _one_rank():
    mesh = build_mesh(MeshConfig())
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = apply_zero(model, ZeroConfig(ZeroStage.PARAMETERS), mesh) is model
    return same, [str(w.message) for w in caught], hasattr(model.weight, "full_tensor")


def test_zero_on_one_rank_warns_that_it_shards_nothing_and_a_bad_stage_names_the_choices(tmp_path, cpu_ranks):
    same, messages, sharded = run_ranks(tmp_path, 1, _one_rank)
    assert same and not sharded
    assert any("ZeRO stage 3 with a data-parallel size of 1 shards nothing" in m for m in messages)
    with pytest.raises(ValueError, match=r"ZeRO stage 4 does not exist; valid stages are 0, 1, 2, 3"):
        ZeroConfig(4)
