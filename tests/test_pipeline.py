"""Pipeline parallelism on gloo: every schedule, 2 and 4 stages, equals one process on the whole
batch (the GPT example's decoder, 5 AdamW steps, weights to 1e-5)."""

import pytest
import torch

from conftest import load_example, run_ranks

from hetero.parallel.pipeline_plan import PipelineConfig, Schedule, pipeline_units, split_points

STEPS, BATCH, LAYERS = 5, 8, 4


def _lm():
    return load_example("lm_host_adam")


def _model(lm):
    torch.manual_seed(0)
    return lm.Decoder(64, 32, LAYERS, 4, 16)


def _batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 64, (BATCH, 16), generator=g), torch.randint(0, 64, (BATCH, 16), generator=g))
            for _ in range(STEPS)]


def _reference():
    lm = _lm()
    model = _model(lm)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses, grads = [], {}
    for x, y in _batches():
        opt.zero_grad()
        loss = lm.lm_loss(model(x), y)
        loss.backward()
        grads = grads or {k: p.grad.clone() for k, p in model.named_parameters()}  # the first step's (Adam hides scale)
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, grads


def _pipelined(config, pp, host=False):
    import torch.distributed as dist

    from hetero.optim import HostAdamW, HostOffloadConfig
    from hetero.parallel.mesh import MeshConfig, build_mesh
    from hetero.parallel.pipeline import pipeline

    lm = _lm()
    mesh = build_mesh(MeshConfig(pp=pp))
    pipe = pipeline(_model(lm), config, mesh, lm.lm_loss)
    if host:  # HostAdamW sums the micro-batches' gradients on the device, then streams them once
        offload = HostOffloadConfig(device_dtype=torch.float32, bucket_bytes=4096, accumulate=config.micro_batches)
        opt = HostAdamW(pipe.named_parameters(), lr=3e-3, weight_decay=0.1, config=offload,
                        process_group=mesh["dp"].get_group())  # its replicas: the dp ranks, not the stages
    else:
        opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3, weight_decay=0.1)
    losses, grads = [], {}
    for x, y in _batches():
        opt.zero_grad()
        losses.append(pipe.step(x, y))
        if not host:  # (HostAdamW took the gradients to the host)
            grads = grads or {k: p.grad.clone() for k, p in pipe.named_parameters()}
        opt.step()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, ({k: v.detach().clone() for m in pipe.modules for k, v in m.state_dict().items()}, grads))
    import hetero
    from hetero.parallel.mesh import MeshDim

    text = str(hetero.explain(_model(lm), (x,), mesh={MeshDim.PP: pp}, pipeline=pipe).pipeline)
    return ({k: v for part, _ in parts for k, v in part.items()}, losses, {k: v for _, g in parts for k, v in g.items()},
            (pipe.bubble, text))


@pytest.mark.parametrize("n,config,host", [
    (2, PipelineConfig(Schedule.GPIPE, micro_batches=4), False),
    (2, PipelineConfig(Schedule.ONE_F_ONE_B, micro_batches=4), False),
    (2, PipelineConfig(Schedule.INTERLEAVED_1F1B, micro_batches=4, stages_per_rank=2), False),  # 4 stages, 2 ranks
    (2, PipelineConfig(Schedule.INTERLEAVED_ZERO_BUBBLE, micro_batches=4, stages_per_rank=2), False),
    (4, PipelineConfig(Schedule.ONE_F_ONE_B, micro_batches=8), False),
    (2, PipelineConfig(Schedule.ONE_F_ONE_B, micro_batches=2, split_points=("blocks.3",)), False),  # uneven, by name
    (2, PipelineConfig(Schedule.ONE_F_ONE_B, micro_batches=4), True),  # HostAdamW: host masters and moments
], ids=["gpipe-2", "1f1b-2", "interleaved-1f1b-2x2", "zero-bubble-2x2", "1f1b-4", "1f1b-2-split", "1f1b-2-host"])
def test_every_schedule_trains_as_one_process(tmp_path, cpu_ranks, n, config, host):
    want, want_losses, want_grads = _reference()
    state, losses, grads, (bubble, text) = run_ranks(tmp_path, n, _pipelined, config, n, host)
    predicted = "not modelled" if config.schedule is Schedule.INTERLEAVED_ZERO_BUBBLE else ""
    assert f"predicted bubble {predicted}" in text and f", measured {bubble:.3f} (last step)" in text  # explain, beside
    assert 0 < bubble < 1
    assert set(state) == set(want)  # every parameter in exactly one stage, under its own name
    for k, v in (want_grads if not host else {}).items():  # the micro-batches' gradients add up to the whole batch's
        torch.testing.assert_close(grads[k], v, rtol=1e-5, atol=1e-6, msg=k)
    for k, v in want.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5, msg=k)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)


def test_units_and_split_points_and_their_errors():
    lm = _lm()
    model = _model(lm)
    units = pipeline_units(model)
    assert units == ["tok", "pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
    cuts = split_points(model, 2)
    assert len(cuts) == 1 and cuts[0].startswith("blocks.")  # about half the bytes on each side
    assert len(split_points(model, 8)) == 7
    with pytest.raises(ValueError, match=r"pipeline split point 'blocks.9' is not a unit of Decoder; its units are"):
        split_points(model, 2, ("blocks.9",))
    with pytest.raises(ValueError, match=r"9 pipeline stages for 8 units"):
        split_points(model, 9)
    with pytest.raises(ValueError, match=r"1 split points for 3 stages: give 2"):
        split_points(model, 3, ("blocks.1",))
    with pytest.raises(ValueError, match=r"must be distinct units after the first, in model order"):
        split_points(model, 3, ("blocks.2", "blocks.1"))
    with pytest.raises(ValueError, match=r"stages_per_rank=1 with schedule interleaved_1f1b: that schedule takes"):
        PipelineConfig(Schedule.INTERLEAVED_1F1B)
    with pytest.raises(ValueError, match=r"pipeline schedule 'pipedream' does not exist; valid schedules are"):
        PipelineConfig("pipedream")
    seq = torch.nn.Module()
    seq.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"Module.layers is an nn.ModuleList: make it an nn.ModuleDict"):
        split_points(seq, 1)


def test_a_stage_shares_the_models_units_and_its_own_parameters_go_with_the_first():
    from hetero.models.wide_deep import FeatureSlot, WideDeep, pipeline_split_points
    from hetero.parallel.pipeline import stage_module

    model = WideDeep([FeatureSlot("a", 10), FeatureSlot("b", 20)], 3)
    units = pipeline_units(model)
    assert pipeline_split_points(model, 2) == ("mlp.4",)  # 35 x 256 + 256 x 128 of the MLP's weights | 128 x 1
    first = stage_module(model, units, units[: units.index("mlp.2")], first=True)  # (a split by name)
    rest = stage_module(model, units, units[units.index("mlp.2"):], first=False)
    assert first.deep is model.deep and first.mlp["0"] is model.mlp["0"]  # the host tables are not copied
    assert first.wide_bias is model.wide_bias and rest.wide_bias is None  # the model's own parameter: stage 0's
    assert list(first.mlp) == ["0", "1"] and list(rest.mlp) == ["2", "3", "4"] and list(model.mlp) == ["0", "1", "2", "3", "4"]
    assert set(first.state_dict()) | set(rest.state_dict()) == set(model.state_dict())
    assert not set(first.state_dict()) & set(rest.state_dict())
    with pytest.raises(ValueError, match=r"5 pipeline stages for a Wide & Deep MLP of 3 Linear layers: use at most 3"):
        pipeline_split_points(model, 5)


def _pipelined_2d(dim, config):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hetero.parallel.mesh import MeshConfig, MeshDim, build_mesh
    from hetero.parallel.pipeline import pipeline

    lm = _lm()
    mesh = build_mesh(MeshConfig(pp=2, tp=2 if dim == "tp" else 1))  # 4 ranks: pp 2 x dp 2, or pp 2 x tp 2
    if dim == "dp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        stage_fn = lambda m: replicate(m, mesh=mesh[MeshDim.DP.value])  # noqa: E731
        dp, dp_rank = 2, mesh[MeshDim.DP.value].get_local_rank()
    else:
        stage_fn = lambda m: lm.tensor_parallel(m, mesh[MeshDim.TP.value], 4, shard_logits=False)  # noqa: E731
        dp, dp_rank = 1, 0
    pipe = pipeline(_model(lm), config, mesh, lm.lm_loss, stage_fn)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    share = BATCH // dp
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    grads = {}
    for x, y in _batches():
        opt.zero_grad()
        pipe.step(x[dp_rank * share:(dp_rank + 1) * share], y[dp_rank * share:(dp_rank + 1) * share])
        grads = grads or {k: full(p.grad).clone() for k, p in pipe.named_parameters()}
        opt.step()
    state = {k: full(v).detach().clone() for m in pipe.modules for k, v in m.state_dict().items()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (state, grads))
    return {k: v for part, _ in parts for k, v in part.items()}, {k: v for _, g in parts for k, v in g.items()}


@pytest.mark.parametrize("dim", ["dp", "tp"])
def test_pipeline_composes_with_data_and_operator_parallel_on_a_2x2_mesh(tmp_path, cpu_ranks, dim):
    want, _, want_grads = _reference()
    state, grads = run_ranks(tmp_path, 4, _pipelined_2d, dim, PipelineConfig(Schedule.ONE_F_ONE_B, micro_batches=2))
    assert set(state) == set(want)
    for k, v in want_grads.items():
        torch.testing.assert_close(grads[k], v, rtol=1e-5, atol=1e-6, msg=k)
    for k, v in want.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5, msg=k)


def test_predicted_bubble_is_the_schedules_idle_fraction():
    from hetero.parallel.pipeline_plan import predicted_bubble

    assert predicted_bubble(Schedule.ONE_F_ONE_B, 2, 2) == pytest.approx(1 / 3)  # (p - 1) / (m + p - 1)
    assert predicted_bubble(Schedule.GPIPE, 4, 8) == pytest.approx(3 / 11)
    assert predicted_bubble(Schedule.INTERLEAVED_1F1B, 2, 4, 2) == pytest.approx(1 / 9)  # v m in the denominator
    assert predicted_bubble(Schedule.INTERLEAVED_1F1B, 2, 1, 2) == pytest.approx(0.5)  # one micro-batch: sequential
    assert predicted_bubble(Schedule.INTERLEAVED_ZERO_BUBBLE, 2, 4, 2) is None


def _example(argv):
    return _lm().main(argv)


@pytest.mark.parametrize("extra", [["--optimizer", "adamw", "--pp", "2", "--schedule", "1f1b"],
                                   ["--optimizer", "adamw", "--pp", "2", "--schedule", "interleaved_1f1b", "--tp", "2"],
                                   ["--optimizer", "adamw", "--pp", "2", "--schedule", "gpipe", "--zero", "3"],
                                   ["--optimizer", "host", "--device-dtype", "fp32", "--pp", "2", "--zero", "1"]],
                         ids=["1f1b", "interleaved+tp", "gpipe+zero3", "host-adamw+zero-offload"])
def test_the_gpt_example_trains_pipelined(tmp_path, cpu_ranks, extra):
    # --max-grad-norm 0.1 clips every step: each stage must scale by the norm over all stages
    argv = ["--steps", "6", "--layers", "4", "--d-model", "32", "--heads", "4", "--context", "16", "--batch-size", "8",
            "--corpus-bytes", "20000", "--max-grad-norm", "0.1", "--micro-batches", "2", *extra]
    result = run_ranks(tmp_path, 4, _example, argv)
    assert result["pp"] == 2 and result["micro_batches"] == 2 and result["dp"] * result["tp"] == 2
    assert 0 < result["bubble"] < 1
    # one process, no pipeline: the same batches, optimizer, device dtype and clipping
    plain = [a for i, a in enumerate(argv) if a not in ("--pp", "--micro-batches", "--schedule", "--tp", "--zero")
             and argv[i - 1] not in ("--pp", "--micro-batches", "--schedule", "--tp", "--zero")]
    want = _lm().main(plain)
    assert result["final_train_loss"] == pytest.approx(want["final_train_loss"], abs=1e-5)
    assert result["valid_loss"] == pytest.approx(want["valid_loss"], abs=1e-5)


def test_the_gpt_example_refuses_a_loss_scale_in_a_pipeline():
    with pytest.raises(ValueError, match=r"--pp > 1 runs AdamW or the host optimizer with bf16 or fp32 device weights"):
        _lm().main(["--steps", "1", "--pp", "2", "--device-dtype", "fp16"])


def _train_and_save(pp, steps, path, load_from):
    """Train ``steps`` of the batches (after ``load_from``'s, if given) at ``pp`` stages (1: no
    pipeline), save weights and AdamW state to ``path``; return the whole model's weights."""
    import torch.distributed as dist

    from hetero.parallel.checkpoint_state import load_distributed_checkpoint, save_distributed_checkpoint
    from hetero.parallel.mesh import MeshConfig, build_mesh
    from hetero.parallel.pipeline import pipeline

    lm = _lm()
    model = _model(lm)
    if pp > 1:
        pipe = pipeline(model, PipelineConfig(Schedule.ONE_F_ONE_B, micro_batches=2), build_mesh(MeshConfig(pp=pp)),
                        lm.lm_loss)
        (stage,) = pipe.modules
    else:
        build_mesh(MeshConfig())
        stage = model
    opt = torch.optim.AdamW(stage.parameters(), lr=3e-3, weight_decay=0.1)
    done = 0
    if load_from is not None:
        load_distributed_checkpoint(stage, load_from, optimizer=opt)
        done = opt.state_dict()["state"][0]["step"].int().item()
    for x, y in _batches()[done:done + steps]:
        opt.zero_grad()
        if pp > 1:
            pipe.step(x, y)
        else:
            lm.lm_loss(stage(x), y).backward()
        opt.step()
    if path is not None:
        save_distributed_checkpoint(stage, path, optimizer=opt)
    parts = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    mine = {k: v.detach().clone() for k, v in stage.state_dict().items()}
    if len(parts) > 1:
        dist.all_gather_object(parts, mine)
    else:
        parts = [mine]
    return {k: v for part in parts for k, v in part.items()}


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)], ids=["pp2-to-pp1", "pp1-to-pp2"])
def test_a_checkpoint_moves_between_pipeline_degrees(tmp_path, cpu_ranks, first, then):
    want, _, _ = _reference()  # 5 uninterrupted steps in one process
    ckpt = tmp_path / "ckpt"
    run_ranks(tmp_path, first, _train_and_save, first, 3, str(ckpt), None)
    state = run_ranks(tmp_path, then, _train_and_save, then, 2, None, str(ckpt))
    for k, v in want.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5, msg=k)


def test_explain_prints_the_stages_and_the_predicted_bubble():
    import hetero
    from hetero.parallel.mesh import MeshDim

    lm = _lm()
    config = PipelineConfig(Schedule.INTERLEAVED_1F1B, micro_batches=4, stages_per_rank=2)
    report = hetero.explain(_model(lm), (torch.zeros(2, 16, dtype=torch.long),), mesh={MeshDim.PP: 2}, pipeline=config)
    plan = report.pipeline
    assert [units for units, _ in plan.stages][0][0] == "tok" and plan.stages[-1][0][-1] == "head"
    assert sum(nbytes for _, nbytes in plan.stages) == sum(p.numel() * 4 for p in _model(lm).parameters())
    assert plan.predicted_bubble == pytest.approx(1 / 9)
    assert "pipeline: 4 stages on 2 ranks, interleaved_1f1b, 4 micro-batches, predicted bubble 0.111" in str(report)


def test_a_pipelined_checkpoint_merges_into_the_whole_model(tmp_path, cpu_ranks):
    from hetero.checkpoint import load_checkpoint
    from hetero.cli import merge

    ckpt = tmp_path / "ckpt"
    want = run_ranks(tmp_path, 2, _train_and_save, 2, 3, str(ckpt), None)  # each stage wrote its part
    merged = load_checkpoint(merge(ckpt, tmp_path / "merged.pt"))
    model = _model(_lm())
    model.load_state_dict(merged["model"])  # plain tensors, whole, every stage's
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)


def test_a_pipeline_wider_than_the_world_is_refused_naming_the_divisors():
    from hetero.parallel.mesh import MeshConfig

    with pytest.raises(ValueError, match=r"a mesh of pp=4 x tp=1 does not divide the world size 2; choose pp \* tp among "
                                         r"the divisors of 2: \[1, 2\]"):
        MeshConfig(pp=4).shape(2)


def _indivisible():
    from hetero.parallel.mesh import MeshConfig, build_mesh
    from hetero.parallel.pipeline import pipeline

    lm = _lm()
    pipe = pipeline(_model(lm), PipelineConfig(micro_batches=3), build_mesh(MeshConfig()), lm.lm_loss)  # pp 1
    x, y = _batches()[0]
    try:
        pipe.step(x, y)
    except ValueError as e:
        return str(e)
    return None


def test_micro_batches_that_do_not_divide_the_batch_are_refused(tmp_path, cpu_ranks):
    assert run_ranks(tmp_path, 1, _indivisible) == ("3 micro-batches do not divide the batch of 8: choose a batch size "
                                                    "that is a multiple of the micro-batches")
