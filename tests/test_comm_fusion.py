"""Communication fusion: the configured buckets are the collectives a run issues (counted on the
c10d ops, not taken from hetero's own bookkeeping), and training equals one process."""

import pytest
import torch
from torch import nn

from conftest import run_ranks

from hetero.parallel.comm import Collective, CollectiveCounter
from hetero.parallel.comm_fusion import MB, CommFusion, FusionMode, gradient_buckets

STEPS, BATCH = 3, 8


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)]


def _ddp_run(fusion, mean):
    import torch.distributed as dist

    from hetero.parallel import DataParallelConfig, data_parallel

    model = _model()
    net = data_parallel(model, DataParallelConfig(fusion, gradients_mean=mean))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    r, n = dist.get_rank(), dist.get_world_size()
    counted = []
    for x, y in _data():
        part = slice(r * BATCH // n, (r + 1) * BATCH // n)
        opt.zero_grad()
        with CollectiveCounter() as c:
            nn.functional.mse_loss(net(x[part]), y[part]).backward()
        counted.append([call.input_bytes // 4 for call in c.calls if call.kind is Collective.ALL_REDUCE])
        opt.step()
    return counted, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference(scale):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _data():
        opt.zero_grad()
        (nn.functional.mse_loss(model(x), y) * scale).backward()
        opt.step()
    return model.state_dict()


# parameter elements, registration order: 128, 16, 256, 16, 64, 4
SIZES = [128, 16, 256, 16, 64, 4]


def test_gradient_buckets_by_size_and_by_index():
    bytes_ = [4 * s for s in SIZES]
    assert gradient_buckets(bytes_, (2, 4)) == [[5, 4], [3, 2], [1, 0]]
    assert gradient_buckets(bytes_, 300 * 4 / MB) == [[5, 4, 3, 2], [1, 0]]  # 4+64+16+256 = 340 >= 300 closes
    assert gradient_buckets(bytes_, FusionMode.AUTO) == [[5, 4, 3, 2, 1, 0]]
    with pytest.raises(ValueError, match="index 6 is past the last parameter: the model has 6"):
        gradient_buckets(bytes_, (2, 6))


@pytest.mark.parametrize("fusion,mean,expected", [
    (CommFusion(allreduce=300 * 4 / MB), True, [340, 144]),
    (CommFusion(allreduce=(2, 4)), True, [68, 272, 144]),
    (CommFusion(allreduce=(2, 4)), False, [68, 272, 144]),
])
def test_ddp_buckets_are_the_configured_fusion(tmp_path, fusion, mean, expected):
    counted, state = run_ranks(tmp_path, 2, _ddp_run, fusion, mean)
    # DDP rebuilds its buckets in backward's real order after the first step: from then on, every
    # step issues exactly the configured all-reduces (an index list: from the first step)
    assert counted[-1] == expected and counted[-2] == expected
    predicted = [sum(SIZES[i] for i in b) for b in gradient_buckets([4 * s for s in SIZES], fusion.allreduce)]
    assert predicted == expected
    reference = _reference(1.0 if mean else 2.0)  # summed gradients: two ranks' means
    for k, v in reference.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(allreduce=0), "CommFusion.allreduce=0: valid values are FusionMode.AUTO or a size in MB > 0"),
    (dict(allreduce=(3, 2)), r"CommFusion.allreduce=\(3, 2\): an index list must be strictly increasing"),
    (dict(allreduce=(0, 2)), "strictly increasing parameter indices > 0"),
    (dict(allgather=(1, 2)), "CommFusion.allgather=.*only allreduce takes an index list"),
    (dict(reducescatter=float("nan")), "CommFusion.reducescatter=nan: valid values"),
    (dict(allgather="auto"), "CommFusion.allgather='auto': valid values are FusionMode.AUTO"),
])
def test_bad_fusion_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CommFusion(**kwargs)


def _host_adam_run(fusion, sharded):
    import torch.distributed as dist

    from hetero.optim import HostAdamW, HostOffloadConfig, ShardedHostAdamW
    from hetero.parallel.comm_fusion import host_offload_config

    model = _model()
    config = host_offload_config(fusion, HostOffloadConfig(device_dtype=torch.float32, overlap=False), sharded=sharded)
    opt = (ShardedHostAdamW if sharded else HostAdamW)(model.parameters(), lr=1e-2, config=config)
    r, n = dist.get_rank(), dist.get_world_size()
    counted = []
    for x, y in _data():
        part = slice(r * BATCH // n, (r + 1) * BATCH // n)
        nn.functional.mse_loss(model(x[part]), y[part]).backward()
        with CollectiveCounter() as c:  # overlap off: the exchange runs in step(), on this thread
            opt.step()
        counted.append([(call.kind, call.input_bytes) for call in c.calls])
    return counted, {k: v.detach().float().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("sharded,setting,buckets", [
    (False, (2, 4), [[5, 4], [3, 2], [1, 0]]),
    (False, 300 * 4 / MB, [[5, 4, 3, 2], [1, 0]]),
    (True, 300 * 4 / MB, [[5, 4, 3, 2], [1, 0]]),  # reduce-scatter fuses by size only
], ids=["HostAdamW-index", "HostAdamW-MB", "ShardedHostAdamW-MB"])
def test_host_adam_buckets_are_one_collective_each(tmp_path, sharded, setting, buckets):
    fusion = CommFusion(reducescatter=setting) if sharded else CommFusion(allreduce=setting)
    counted, state = run_ranks(tmp_path, 2, _host_adam_run, fusion, sharded)
    expected, gathers = [], []
    for b in buckets:
        expected.append((Collective.ALL_REDUCE, 4 * len(b)))  # which slots got a gradient on any rank (int32 flags)
        nbytes = 4 * sum(SIZES[i] for i in b)
        if sharded:  # one reduce-scatter of the bucket; after all reductions, one all-gather of its new weights
            expected.append((Collective.REDUCE_SCATTER, nbytes))
            gathers.append((Collective.ALL_GATHER, nbytes // 2))
        else:
            expected.append((Collective.ALL_REDUCE, nbytes))
    if sharded:  # the global gradient norm's sum of squares over the shards (float64 sum, finite flag)
        expected.append((Collective.ALL_REDUCE, 16))
    expected += gathers
    assert counted[-1] == expected
    model = _model()  # one process on the whole batch, torch's own AdamW
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _data():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def _tables_run(fusion, sharded):
    import torch.distributed as dist

    from hetero.embedding import HostEmbedding, TableConfig, host_tables
    from hetero.optim import LazyAdam
    from hetero.optim.sparse import LazyAdamConfig
    from hetero.parallel import DataParallelConfig, DistributedSparse, shard_rows

    torch.manual_seed(0)
    model = nn.ModuleDict({f"t{d}": HostEmbedding(TableConfig(f"t{d}", 50, d)) for d in (2, 4, 8)})  # three groups
    n = dist.get_world_size() if dist.is_initialized() else 1
    r = dist.get_rank() if n > 1 else 0
    if sharded and n > 1:
        shard_rows(model)
    opt = DistributedSparse(LazyAdam(host_tables(model), LazyAdamConfig(lr=0.05)), DataParallelConfig(fusion))
    g = torch.Generator().manual_seed(3)
    counted = []
    for _ in range(STEPS):
        ids = torch.randint(0, 50, (BATCH,), generator=g)
        mine = ids[r * BATCH // n:(r + 1) * BATCH // n]
        opt.zero_grad()
        loss = sum((t(mine) ** 2).sum() * (d + 1) for d, t in zip((2, 4, 8), model.values())) / len(mine)
        loss.backward()  # the mean over this rank's share: the ranks' means average to the whole batch's
        with CollectiveCounter() as c:
            opt.step()
        counted.append([(call.kind, call.input_bytes) for call in c.calls])
    from hetero.parallel import full_model_state
    from hetero.parallel.dp_plan import plan_collectives

    planned = [c.kind for c in plan_collectives(model, (), 2).calls if "per lookup" not in c.what]
    state = full_model_state(model) if n > 1 else model.state_dict()
    return (counted, planned), {k: v.detach().clone() for k, v in state.items()}


@pytest.mark.parametrize("sharded,fusion,kinds", [
    (False, CommFusion(), [Collective.ALL_GATHER] * 2),  # the row counts, then one bucket of all three groups
    (False, CommFusion(allgather=1e-9), [Collective.ALL_GATHER] * 4),  # tiny buckets: one all-gather per group
    (True, CommFusion(), [Collective.ALL_REDUCE, Collective.ALL_TO_ALL]),  # touched flags, all groups' rows at once
], ids=["replicated-auto", "replicated-per-group", "row-sharded"])
def test_sparse_exchange_is_fused_over_table_groups(tmp_path, sharded, fusion, kinds):
    (counted, planned), state = run_ranks(tmp_path, 2, _tables_run, fusion, sharded)
    assert [kind for kind, _ in counted[-1]] == kinds
    if fusion == CommFusion():  # what hetero.explain plans for the step (the rows' bucket count is the batch's)
        assert planned == kinds
    _, want = _tables_run(fusion, sharded)  # one process, the whole batch
    for k, v in want.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)
