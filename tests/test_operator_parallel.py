"""Operator-level parallelism: sharded operators on DTensor equal the unsharded ones (gloo ranks)."""

import pytest
import torch
from torch import nn

from conftest import load_example, run_ranks

from hetero.parallel.mesh import MeshConfig, build_mesh
from hetero.parallel.operator import shard


def _example():
    return load_example("semi_auto_parallel")


SemiAutoNet = _example().SemiAutoNet  # the reference design's network, as the example defines it
_inputs = _example().inputs


def _semi_auto(tp, strategy):
    mesh = build_mesh(MeshConfig(tp=tp))
    y, eq = SemiAutoNet(mesh, strategy)(_inputs())
    assert any(type(p).__name__ == "Shard" for p in y.placements), y.placements  # computed in shards
    return y.full_tensor(), eq.full_tensor()


@pytest.mark.parametrize("n,tp,strategy", [(2, 2, ((1, 2), (1, 2))), (2, 2, ((2, 1), (2, 1))),
                                           (4, 2, ((2, 2), (2, 2)))])
def test_the_reference_semi_auto_network_equals_one_process(tmp_path, cpu_ranks, n, tp, strategy):
    want_y, want_eq = SemiAutoNet()(_inputs())
    y, eq = run_ranks(tmp_path, n, _semi_auto, tp, strategy)
    torch.testing.assert_close(y, want_y.detach(), rtol=0, atol=0)
    assert torch.equal(eq, want_eq) and eq.any()


def _matmul(tp, strategy):
    mesh = build_mesh(MeshConfig(tp=tp))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 12, generator=g, requires_grad=True)
    w = torch.randn(12, 6, generator=g, requires_grad=True)
    out = shard(torch.matmul, strategy, mesh=mesh, signature="matmul")(x, w)
    placements = [type(p).__name__ for p in out.placements]
    full = out.full_tensor()
    (full * torch.arange(full.numel()).view_as(full)).sum().backward()
    return full.detach(), x.grad, w.grad, placements


@pytest.mark.parametrize("n,tp,strategy", [
    (2, 2, ((2, 1), (1, 1))),  # rows of x
    (2, 2, ((1, 2), (2, 1))),  # the contraction: partial sums, reduced when gathered
    (2, 2, ((1, 1), (1, 2))),  # columns of w
    (4, 2, ((2, 2), (2, 1))),  # rows on dp, the contraction on tp
    (4, 2, ((2, 1), (1, 2))),  # rows on dp, columns on tp
])
def test_a_matmul_sharded_on_each_dimension_equals_one_process(tmp_path, cpu_ranks, n, tp, strategy):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 12, generator=g, requires_grad=True)
    w = torch.randn(12, 6, generator=g, requires_grad=True)
    want = x @ w
    (want * torch.arange(want.numel()).view_as(want)).sum().backward()
    out, gx, gw, placements = run_ranks(tmp_path, n, _matmul, tp, strategy)
    torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-5)
    assert set(placements) != {"Replicate"}  # the work was really split (no replicated compute)
    if strategy[0][1] > 1:
        assert "Partial" in placements  # the contraction: partial sums on each rank


def _bad_inputs():
    mesh = build_mesh(MeshConfig(tp=2))
    x, w = torch.randn(6, 5), torch.randn(5, 4)
    errors = []
    for strategy, sig in ((((1, 2), (2, 1)), "matmul"),   # 5 does not divide in 2
                          (((2, 1),), "matmul"),            # one strategy for two inputs
                          (((2, 1, 1), (1, 1)), "matmul"),  # three slice counts for two dimensions
                          (((1, 1), (1, 1)), "matmul"),     # a device matrix of 1 on 2 ranks
                          (((3, 1), (1, 1)), "matmul")):    # 3 slices: no mesh dimension of 3
        try:
            shard(torch.matmul, strategy, mesh=mesh, signature=sig, name="fc.matmul")(x, w)
        except ValueError as e:
            errors.append(str(e))
    try:
        shard(torch.mul, ((2, 1), (1, 1)), mesh=mesh, name="mul")(torch.randn(4, 4), torch.randn(4, 4))
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_bad_strategies_name_the_op_input_dimension_and_the_valid_choices(tmp_path, cpu_ranks):
    errors = run_ranks(tmp_path, 2, _bad_inputs)
    assert errors == [
        "sharding strategy of fc.matmul: input 0 dimension 1 (size 5) cannot be cut in 2 slices; valid slice counts "
        "are the divisors of 5: [1, 5]",
        "sharding strategy of fc.matmul: 1 input strategies for 2 tensor inputs; give one tuple per input",
        "sharding strategy of fc.matmul: input 0 has 2 dimensions (6, 5), its strategy (2, 1, 1) has 3; give one "
        "slice count per dimension",
        "sharding strategy of fc.matmul: the device matrix (1, 1, 1) multiplies to 1, the mesh's dp x tp part has 2 "
        "ranks ({'dp': 1, 'tp': 2}); the slice counts must multiply to 2",
        "sharding strategy of fc.matmul: the device matrix (3, 1, 1) multiplies to 3, the mesh's dp x tp part has 2 "
        "ranks ({'dp': 1, 'tp': 2}); the slice counts must multiply to 2",
        "sharding strategy of mul: input 1 dimension 0 is cut in 1 slices, but another input cuts the same dimension "
        "('a' of the elementwise op) in 2; give both the same slice count",
    ]


def test_a_mesh_that_does_not_divide_the_world_names_the_choices():
    with pytest.raises(ValueError, match=r"a mesh of pp=1 x tp=3 does not divide the world size 4; choose pp \* tp "
                                         r"among the divisors of 4: \[1, 2, 4\]"):
        MeshConfig(tp=3).shape(4)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _mlp_data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(5)]


def _mlp_train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _mlp_data():
        opt.zero_grad()
        out = model(x)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}
    return losses, state


def _mlp_sharded(tp, plan_args, strategy_file=None):
    from hetero.parallel.operator_plan import ShardingPlan, apply_sharding, load_strategy, save_strategy

    mesh = build_mesh(MeshConfig(tp=tp))
    model = _mlp()
    plan = ShardingPlan()
    for name, strategy, out in plan_args:
        plan.module(name, strategy, out)
    layout = apply_sharding(model, plan, mesh)
    local = {k: tuple(p.to_local().shape) for k, p in model.named_parameters()}
    if strategy_file is not None:
        save_strategy(strategy_file, mesh, layout)
        load_strategy(strategy_file, mesh, layout)  # the same model: no difference
    return (*_mlp_train(model), local)


@pytest.mark.parametrize("n,tp,plan", [
    # column-parallel then row-parallel (Megatron's MLP): one all-reduce of the output
    (2, 2, [("0", ((1, 1), (1, 2)), None), ("2", ((1, 2), (2, 1)), (1, 1))]),
    # the same with the batch cut over the data-parallel dimension of a 2 x 2 mesh
    (4, 2, [("0", ((2, 1), (1, 2)), None), ("2", ((2, 2), (2, 1)), (2, 1))]),
])
def test_a_column_then_row_parallel_mlp_trains_as_one_process(tmp_path, cpu_ranks, n, tp, plan):
    ref_losses, ref_state = _mlp_train(_mlp())
    losses, state, local = run_ranks(tmp_path, n, _mlp_sharded, tp, plan, str(tmp_path / "strategy.json"))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert local["0.weight"] == (16, 16) and local["2.weight"] == (8, 16)  # each rank stores half of each weight
    import json

    doc = json.loads((tmp_path / "strategy.json").read_text())
    assert doc["layout"]["0.weight"] == (["R", "R", "S(0)"]) and doc["layout"]["2.weight"] == ["R", "R", "S(1)"]


def _strategy_files(path):
    from hetero.parallel.operator_plan import ShardingPlan, apply_sharding, load_strategy, save_strategy

    mesh = build_mesh(MeshConfig(tp=2))
    layout = apply_sharding(_mlp(), ShardingPlan().module("0", ((1, 1), (1, 2))).module("2", ((1, 2), (2, 1))), mesh)
    first = save_strategy(f"{path}/a.json", mesh, layout).read_bytes()
    again = save_strategy(f"{path}/b.json", mesh, load_strategy(f"{path}/a.json", mesh)).read_bytes()
    other = apply_sharding(_mlp(), ShardingPlan().module("0", ((1, 1), (1, 2))).module("2", ((1, 1), (1, 2))), mesh)
    errors = []
    for bad in (lambda: load_strategy(f"{path}/a.json", mesh, other),
                lambda: apply_sharding(_mlp(), ShardingPlan().module("fc9", ((1, 1), (1, 2))), mesh),
                lambda: apply_sharding(_mlp(), ShardingPlan().module("1", ((1, 1), (1, 2))), mesh)):
        try:
            bad()
        except ValueError as e:
            errors.append(str(e))
    return first, again, errors


def test_a_strategy_file_round_trips_bitwise_and_a_mismatch_names_the_first_name(tmp_path, cpu_ranks):
    first, again, errors = run_ranks(tmp_path, 2, _strategy_files, str(tmp_path))
    assert first == again
    assert errors == [
        f"strategy file {tmp_path}/a.json differs from the model at '2.bias': ['R', 'R', 'R'] in the file, ['R', 'R', 'S(0)'] "
        f"in the model",
        "sharding plan names module 'fc9', which Sequential does not have; its modules are ['0', '1', '2']",
        "sharding plan names module '1', a ReLU; operator strategies apply to nn.Linear modules",
    ]


def _loss_parallel(tp):
    from torch.distributed.tensor.parallel import loss_parallel

    from hetero.parallel.operator_plan import ShardingPlan, apply_sharding

    mesh = build_mesh(MeshConfig(tp=tp))
    torch.manual_seed(0)
    head = nn.Linear(16, 10)
    apply_sharding(head, ShardingPlan().module("", ((1, 1), (1, 2))), mesh)  # column-parallel: classes cut on tp
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    logits = head(x)
    kept = [type(p).__name__ + str(getattr(p, "dim", "")) for p in logits.placements]
    with loss_parallel():  # cross-entropy on the class shards: no rank gathers the logits
        # (torch's loss_parallel takes the mean on 1-D meshes only: the sum over a batch of 8 here)
        loss = nn.functional.cross_entropy(logits, y, reduction="sum") / 8
        loss.backward()
    return loss.full_tensor().item(), head.weight.grad.full_tensor(), kept


def test_cross_entropy_over_class_sharded_logits_equals_one_process(tmp_path, cpu_ranks):
    torch.manual_seed(0)
    head = nn.Linear(16, 10)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    want = nn.functional.cross_entropy(head(x), y)
    want.backward()
    loss, grad, kept = run_ranks(tmp_path, 2, _loss_parallel, 2)
    assert kept[-1] == "Shard1"  # the logits stayed cut along the classes
    assert loss == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(grad, head.weight.grad, rtol=1e-5, atol=1e-6)


class _TableMLP(nn.Module):
    """A host table looked up by ids, then the MLP: a checkpoint holds both, and LazyAdam's rows."""

    def __init__(self):
        super().__init__()
        from hetero.embedding import HostEmbedding, TableConfig

        self.mlp = _mlp()
        self.table = HostEmbedding(TableConfig("t", 40, 16, init_std=0.5))

    def forward(self, ids):
        return self.mlp(self.table(ids))


def _table_mlp_train(model):
    from hetero.optim import LazyAdam, LazyAdamConfig

    dense = torch.optim.SGD(model.mlp.parameters(), lr=0.1)
    sparse = LazyAdam([model.table], LazyAdamConfig(lr=0.05))
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        ids, y = torch.randint(0, 40, (8,), generator=g), torch.randn(8, 8, generator=g)
        dense.zero_grad()
        out = model(ids)
        loss = nn.functional.mse_loss(out.full_tensor() if hasattr(out, "full_tensor") else out, y)
        loss.backward()
        dense.step()
        sparse.step()
    return sparse


def _probe():
    return torch.arange(0, 40, 5)  # 8 ids, all of them trained rows or not alike


def _train_and_save(path):
    from hetero.parallel import save_distributed_checkpoint
    from hetero.parallel.operator_plan import ShardingPlan, apply_sharding

    mesh = build_mesh(MeshConfig(tp=2))  # 4 ranks: dp 2 x tp 2
    model = _TableMLP()
    apply_sharding(model, ShardingPlan().module("mlp.0", ((2, 1), (1, 2))).module("mlp.2", ((2, 2), (2, 1)), (2, 1)), mesh)
    sparse = _table_mlp_train(model)
    save_distributed_checkpoint(model, path, {"deep": sparse})
    with torch.no_grad():
        out = model(_probe()).full_tensor()
    return out, {k: v.clone() for k, v in sparse.table_state["t"].items()}, dict(sparse.steps)


def _load_and_predict(path, tp):
    from hetero.optim import LazyAdam, LazyAdamConfig
    from hetero.parallel import infer_predict_layout, load_distributed_checkpoint
    from hetero.parallel.operator_plan import ShardingPlan, apply_sharding

    model = _TableMLP()
    torch.manual_seed(123)
    for p in model.parameters():  # nothing of the initial weights may survive the load
        p.data.normal_()
    sparse = LazyAdam([model.table], LazyAdamConfig(lr=0.05))
    if tp > 1:  # operator-parallel only (dp 1 x tp 2): another layout than the one trained
        mesh = build_mesh(MeshConfig(tp=tp))
        apply_sharding(model, ShardingPlan().module("mlp.0", ((1, 1), (1, 2))).module("mlp.2", ((1, 2), (2, 1)), (1, 1)), mesh)
    layout = infer_predict_layout(model, _probe())
    if tp > 1:  # a layout that is not the model's is refused before anything loads
        with pytest.raises(ValueError, match=r"model's layout differs from the predict layout at 'mlp.0.bias': \[\] asked, "):
            load_distributed_checkpoint(model, path, {**layout, "mlp.0.bias": []})
    load_distributed_checkpoint(model, path, layout, {"deep": sparse})
    with torch.no_grad():
        out = model(_probe())
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    return out, {k: v.clone() for k, v in sparse.table_state["t"].items()}, dict(sparse.steps)


def test_a_checkpoint_trained_at_2x2_predicts_the_same_at_1_rank_and_at_2_operator_parallel(tmp_path, cpu_ranks):
    ckpt = tmp_path / "mlp.dcp"
    want, want_state, want_steps = run_ranks(tmp_path, 4, _train_and_save, str(ckpt))
    assert want_steps == {"t": 5} and want_state["exp_avg"].abs().sum() > 0
    for got, state, steps in (_load_and_predict(str(ckpt), 1), run_ranks(tmp_path, 2, _load_and_predict, str(ckpt), 2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the table's rows and the MLP's shards
        assert steps == want_steps  # LazyAdam's step count, and its moments row by row
        for k in want_state:
            torch.testing.assert_close(state[k], want_state[k], rtol=0, atol=0)


def test_checkpoint_merge_writes_dtensor_shards_and_tables_whole(tmp_path, cpu_ranks):
    from hetero.checkpoint import load_checkpoint
    from hetero.cli import merge

    ckpt = tmp_path / "mlp.dcp"
    want, want_state, want_steps = run_ranks(tmp_path, 4, _train_and_save, str(ckpt))
    merged = load_checkpoint(merge(ckpt, tmp_path / "mlp.pt"))
    model = _TableMLP()
    model.load_state_dict(merged["model"])  # plain tensors, whole: no process group needed
    with torch.no_grad():
        torch.testing.assert_close(model(_probe()), want, rtol=1e-5, atol=1e-5)
    deep = merged["sparse_optimizers"]["deep"]
    assert deep["steps"] == want_steps
    torch.testing.assert_close(deep["state"]["t"]["exp_avg"], want_state["exp_avg"], rtol=0, atol=0)


def _dataset(strategy):
    from hetero.parallel.dataset import DatasetStrategy, shard_batch

    mesh = build_mesh(MeshConfig(tp=1))  # 2 ranks: dp 2
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(8, 6, generator=g), torch.randn(6, 3, generator=g)
    strategy = DatasetStrategy(strategy) if isinstance(strategy, str) else strategy
    (dx,) = shard_batch([x], strategy, mesh)
    out = shard(torch.matmul, ((2, 1), (1, 1)), mesh=mesh, signature="matmul")(dx, w)
    errors = []
    for bad in (((2, 2),), ((3, 1),)):
        try:
            shard_batch([x], bad, mesh)
        except ValueError as e:
            errors.append(str(e))
    return tuple(dx.to_local().shape), out.full_tensor(), errors


@pytest.mark.parametrize("strategy,local", [("full_batch", (8, 6)), ("data_parallel", (4, 6)), (((2, 1),), (4, 6))])
def test_dataset_strategies_feed_the_data_dimension(tmp_path, cpu_ranks, strategy, local):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(8, 6, generator=g), torch.randn(6, 3, generator=g)
    got_local, out, errors = run_ranks(tmp_path, 2, _dataset, strategy)
    assert got_local == local  # what each rank holds of the batch
    torch.testing.assert_close(out, x @ w, rtol=1e-5, atol=1e-6)
    assert errors == [
        "dataset strategy: input 0 is sliced in dimensions [0, 1]; an input is sliced in at most one dimension "
        "(valid: one slice count from [2], the others 1)",
        "dataset strategy: input 0 dimension 0 (size 8) cannot be cut in 3; valid slice counts are the data-parallel "
        "sizes [1, 2] that divide 8",
    ]


@pytest.mark.parametrize("n,strategy", [(2, "1,2"), (4, "2,2")])
def test_the_semi_auto_example_under_torchrun_equals_one_process(cpu_ranks, n, strategy):
    import json
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "semi_auto_parallel.py"
    one = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=120, check=True)
    many = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                           str(example), "--tp", "2", "--strategy", strategy], capture_output=True, text=True,
                          timeout=300)
    assert many.returncode == 0, many.stderr[-2000:]
    want, got = json.loads(one.stdout.strip().splitlines()[-1]), json.loads(many.stdout.strip().splitlines()[-1])
    assert got["world_size"] == n and want["equal_true"] == got["equal_true"] > 0
    assert (got["mul_crc"], got["equal_crc"]) == (want["mul_crc"], want["equal_crc"])  # bitwise


def _lm_example():
    return load_example("lm_host_adam")


def _gpt_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)) for _ in range(5)]


def _gpt_model(lm):
    torch.manual_seed(0)
    return lm.Decoder(64, 32, 2, 4, 16)


def _gpt_reference():
    """One process, torch's own pieces: plain cross-entropy, clip_grad_norm_, AdamW."""
    lm = _lm_example()
    model = _gpt_model(lm)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses, grads = [], None
    for x, y in _gpt_batches():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1))
        loss.backward()
        grads = grads or {k: p.grad.clone() for k, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _gpt_tensor_parallel(tp, recompute=False, zero=0):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from hetero.parallel import ParallelDims, ParallelPlan, RecomputeConfig, RecomputeOp, ZeroConfig, parallelize

    lm = _lm_example()
    mesh = build_mesh(MeshConfig(tp=tp))  # dp = ranks / tp
    model = lm.tensor_parallel(_gpt_model(lm), mesh["tp"], heads=4)
    blocks = ("blocks.0", "blocks.1")
    # after operator sharding, as the composition order has it: recompute regions hold DTensor ops,
    # and ZeRO 3 (FSDP2 over dp) shards the tp shards again: a 2-D mesh
    parallelize(model, ParallelDims.of_mesh(mesh, zero),
                ParallelPlan(recompute=RecomputeConfig(blocks if recompute else (), frozenset({RecomputeOp.MATMUL})),
                             zero=ZeroConfig(zero, blocks), dense=None))
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    sharded = sorted(k for k, p in model.named_parameters() if isinstance(p, DTensor) and p.to_local().numel() < p.numel())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    losses, grads = [], None
    for x, y in _gpt_batches():
        share = len(x) // dp  # this data-parallel rank's rows; the mean over equal shares is the batch's
        x, y = x[dp_rank * share:(dp_rank + 1) * share], y[dp_rank * share:(dp_rank + 1) * share]
        opt.zero_grad()
        with loss_parallel():
            logits = model(x)
            assert isinstance(logits, DTensor) and logits.placements[0].is_shard(2)  # never gathered
            loss = lm.lm_loss(logits, y)
            loss.backward()
        grads = grads or {k: full(p.grad).clone() for k, p in model.named_parameters()}
        lm.clip_grad_norm(model.parameters(), 0.5)
        opt.step()
        value = full(loss).detach().clone()
        torch.distributed.all_reduce(value, group=mesh["dp"].get_group())
        losses.append(value.item() / dp)
    return losses, grads, {k: full(v).detach().clone() for k, v in model.state_dict().items()}, sharded


@pytest.mark.parametrize("n,tp,recompute,zero", [(2, 2, False, 0), (4, 4, False, 0), (2, 2, True, 0), (4, 2, True, 3)])
def test_the_gpt_example_tensor_parallel_trains_as_one_process(tmp_path, cpu_ranks, n, tp, recompute, zero):
    want_losses, want_grads, want_state = _gpt_reference()
    losses, grads, state, sharded = run_ranks(tmp_path, n, _gpt_tensor_parallel, tp, recompute, zero)
    # column-parallel q, k, v, fc and head, row-parallel o and proj: their weights are cut
    assert {"blocks.0.attn.q.weight", "blocks.0.attn.o.weight", "blocks.1.fc.weight", "blocks.1.proj.weight",
            "head.weight"} <= set(sharded)
    assert losses == pytest.approx(want_losses, abs=1e-5)
    for k in want_grads:
        torch.testing.assert_close(grads[k], want_grads[k], rtol=1e-5, atol=1e-5, msg=k)
    for k in want_state:
        torch.testing.assert_close(state[k], want_state[k], rtol=1e-5, atol=1e-5, msg=k)


def test_the_composition_root_refuses_a_table_no_sparse_optimizer_covers():
    """A host table outside every part of the plan's sparse optimizers would never be updated."""
    from torch import nn

    from hetero import HostEmbedding, TableConfig
    from hetero.optim import LazyAdam
    from hetero.parallel import ParallelDims, ParallelPlan, parallelize

    model = nn.ModuleDict({"deep": nn.ModuleDict({"a": HostEmbedding(TableConfig("a", 10, 4))}),
                           "extra": nn.ModuleDict({"b": HostEmbedding(TableConfig("b", 10, 4))})})
    plan = ParallelPlan(sparse={"deep": lambda tables: LazyAdam(list(tables.values()))}, dense=None)
    with pytest.raises(ValueError, match=r"host tables \['extra.b'\] belong to no part"):
        parallelize(model, ParallelDims(), plan)
    made = parallelize(nn.ModuleDict({"deep": model["deep"]}), ParallelDims(), plan)
    assert list(made.sparse_optimizers) == ["deep"]
