"""ZeRO stages 1-3 for device optimizers: N data-parallel ranks equal one process, and each
rank keeps about 1/N of the optimizer state (counted from the live state tensors)."""

import warnings

import pytest
import torch

from conftest import load_example, run_ranks

from hetero.optim.host_state import storage_bytes
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


def _zero_fused_units(limit_mb):
    from hetero.parallel.comm import Collective, CollectiveCounter
    from hetero.parallel.comm_fusion import CommFusion
    from hetero.parallel.zero import fusion_units

    import torch.distributed as dist

    lm = _lm()
    mesh = build_mesh(MeshConfig())
    n, r = dist.get_world_size(), dist.get_rank()
    model = _model(lm)
    units = [sum(p.numel() * 4 for m in unit for p in m.parameters()) for unit in fusion_units(model, limit_mb)]
    config = ZeroConfig(ZeroStage.PARAMETERS)  # no units named: sized by the fusion
    apply_zero(model, config, mesh, CommFusion(allgather=limit_mb, reducescatter=2 * limit_mb))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    share = BATCH // n
    counted = []
    for x, y in _batches():
        opt.zero_grad()
        with CollectiveCounter() as c:
            out = model(x[r * share:(r + 1) * share])
        counted.append([call.input_bytes for call in c.calls if call.kind is Collective.ALL_GATHER])
        lm.lm_loss(out, y[r * share:(r + 1) * share]).backward()
        opt.step()
    return units, counted[-1], {k: _full(v).detach().clone() for k, v in model.state_dict().items()}


def test_zero_units_without_names_are_sized_by_the_comm_fusion(tmp_path, cpu_ranks):
    limit_mb = 60e3 / (1 << 20)  # 60 kB: [tok, pos, blocks.0] and [blocks.1, norm, head] (a block is ~50 kB)
    units, gathers, state = run_ranks(tmp_path, 2, _zero_fused_units, limit_mb)
    assert len(units) == 2 and all(u >= 50e3 for u in units)
    assert gathers == [u // 2 for u in units]  # forward: one all-gather per unit, of this rank's half
    want, _ = _reference()
    for k, v in want.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5, msg=k)


def _counted_step(stage, fusion):
    from collections import Counter

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hetero.parallel.comm import CollectiveCounter
    from hetero.parallel.data_parallel import DataParallelConfig, data_parallel

    lm = _lm()
    mesh = build_mesh(MeshConfig())
    n, r = dist.get_world_size(), dist.get_rank()
    config = ZeroConfig(stage)
    model = apply_zero(_model(lm), config, mesh, fusion)
    net = data_parallel(model, DataParallelConfig(fusion)) if stage < 2 else model
    assert stage >= 2 or isinstance(net, DistributedDataParallel)
    opt = zero_optimizer(model.parameters(), torch.optim.AdamW, config, mesh, lr=3e-3)
    share = BATCH // n
    for x, y in _batches()[:3]:
        opt.zero_grad()
        with CollectiveCounter() as c:
            lm.lm_loss(net(x[r * share:(r + 1) * share]), y[r * share:(r + 1) * share]).backward()
            opt.step()
    return Counter((call.kind, call.input_bytes) for call in c.calls)


@pytest.mark.parametrize("stage,fusion_mb", [(0, 0.02), (1, 0.02), (2, 0.06), (3, 0.06)])
def test_explain_plans_the_collectives_a_step_issues(tmp_path, cpu_ranks, stage, fusion_mb):
    from collections import Counter

    import hetero
    from hetero.parallel.comm_fusion import CommFusion
    from hetero.parallel.mesh import MeshDim

    fusion = CommFusion(allreduce=fusion_mb, allgather=fusion_mb, reducescatter=fusion_mb)
    counted = run_ranks(tmp_path, 2, _counted_step, stage, fusion)
    lm = _lm()
    report = hetero.explain(_model(lm), (torch.zeros(2, 16, dtype=torch.long),), mesh={MeshDim.DP: 2}, fusion=fusion,
                            zero=ZeroConfig(stage))
    planned = Counter((c.kind, c.input_bytes) for c in report.data_parallel.calls)
    assert planned == counted
    assert sum(planned.values()) > 3  # several buckets / units: the sizes matter
    assert "collectives per step" in str(report)


def test_zero_units_are_the_entries_of_a_container_never_the_container():
    """A ModuleDict or ModuleList is never called (the forward calls its entries): as an FSDP2
    unit its unshard hook would never run and its entries would compute on shards."""
    from torch import nn

    from hetero.parallel.zero import fusion_unit_names

    model = nn.Module()
    model.inp = nn.Linear(4, 4)
    model.blocks = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Sequential(nn.Linear(4, 4), nn.ReLU())})
    model.layers = nn.ModuleList([nn.Linear(4, 4)])
    units = fusion_unit_names(model, limit_mb=1.0)  # everything fits one unit by size
    assert units == [["inp", "blocks.a", "blocks.b", "layers.0"]]
