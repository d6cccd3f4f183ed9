"""A GPT-style decoder language model trained with HostAdamW on real text available offline.

Corpus: the Python standard library's own source files (``sysconfig.get_paths()["stdlib"]``),
read as bytes (a 256-token byte-level vocabulary), split 95/5 into train and validation by
position. Model: token + position embeddings, pre-norm causal Transformer blocks, a linear head.

The device keeps only bf16 (or fp16) weights; fp32 master weights and Adam moments live on the
host, and gradients stream to the host during backward. The run ends with the device bytes per
parameter, against 16 for fp32 AdamW on the device. On CUDA, ``--memory-fraction`` caps the
device memory (``torch.cuda.set_per_process_memory_fraction``) to show a model that fits with
HostAdamW and not with ``--optimizer adamw``.

    python examples/lm_host_adam.py --steps 300
    python examples/lm_host_adam.py --optimizer adamw --memory-fraction 0.2   # on CUDA: out of memory
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from collections.abc import Iterable
from pathlib import Path

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from hetero.cli import run_main
from hetero.optim import DynamicLossScaler, HostAdamW, HostOffloadConfig, ShardedHostAdamW, device_memory_report
from hetero.optim.partial_offload import PartialOffloadAdamW, PartialOffloadConfig
from hetero import parallel
from hetero.parallel import MeshConfig, MeshDim, build_mesh
from hetero.parallel.recompute import RecomputeConfig, apply_recompute
from hetero.parallel.dims import ParallelDims
from hetero.parallel.parallelize import ParallelPlan, parallelize
from hetero.parallel.pipeline import pipeline
from hetero.parallel.pipeline_plan import PipelineConfig, Schedule, predicted_bubble
from hetero.parallel.zero import ZeroConfig, apply_zero, zero_optimizer
from hetero.placement import Target, resolve_device


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files, in sorted path order, up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python sources under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v projections, so column-parallel q,
    k, v give each rank whole heads (a packed qkv weight would cut across q, k and v)."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // heads
        # no bias on k: its gradient is zero in exact arithmetic (softmax ignores a shift shared by
        # all keys), so Adam would step on rounding noise; none on q and v alike (as LLaMA, PaLM)
        self.q, self.k, self.v = (nn.Linear(d_model, d_model, bias=False) for _ in range(3))
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: the heads this rank holds (all, or heads / tp when q, k, v are column-parallel)
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm Transformer block: attention and a GELU MLP, each in a residual branch."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads)
        self.fc, self.proj = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"--d-model {d_model} is not a multiple of --heads {heads}")
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        # a ModuleDict ('0', '1', ...): a pipeline stage deletes the blocks it does not hold, names unchanged
        self.blocks = nn.ModuleDict({str(i): Block(d_model, heads) for i in range(layers)})
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A part that is None (or a deleted block) lives in another pipeline stage: this stage
        # then takes, or returns, the hidden state (hetero.parallel.pipeline).
        h = x if self.tok is None else self.tok(x)
        if self.pos is not None:
            h = h + self.pos(torch.arange(h.shape[1], device=h.device))
        for block in self.blocks.values():
            h = block(h)
        h = h if self.norm is None else self.norm(h)
        return h if self.head is None else self.head(h)


def tensor_parallel(model: Decoder, mesh: DeviceMesh, heads: int, shard_logits: bool = True) -> Decoder:
    """Megatron-style operator parallelism over ``mesh`` (1-D, the ``tp`` ranks), in place: q, k,
    v and the MLP's first matmul column-parallel (each rank computes heads / tp heads and 4d / tp
    hidden units), the attention output and the MLP's second matmul row-parallel (one all-reduce
    per branch), the head column-parallel with class-sharded logits for loss parallel
    (``shard_logits``; else gathered into plain logits, as a pipeline's last stage hands them to
    its loss). Embeddings and norms stay replicated. A pipeline stage's absent parts are skipped.
    Reference: Shoeybi et al. 2019 (Megatron-LM); torch's ``parallelize_module``."""
    tp = mesh.size()
    if heads % tp:
        raise ValueError(f"--heads {heads} cannot be split over --tp {tp} ranks; choose --tp among the divisors of "
                         f"{heads}: {[d for d in range(1, heads + 1) if heads % d == 0]}")
    for block in model.blocks.values():
        tensor_parallel_block(block, mesh)
    if model.head is not None:
        # the logits stay cut by class: cross-entropy under loss_parallel never gathers them
        head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if shard_logits else \
            ColwiseParallel(output_layouts=Replicate())
        parallelize_module(model, mesh, {"head": head})
    return model


def tensor_parallel_block(block: Block, mesh: DeviceMesh) -> Block:
    """One block's part of :func:`tensor_parallel`, in place."""
    # attn's input becomes one replicated DTensor shared by q, k and v: their input gradients are
    # summed as partial sums and all-reduced once in backward (three times if each converted it)
    block_plan = {"attn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                             use_local_output=False),
                  "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                  "attn.o": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()}
    return parallelize_module(block, mesh, block_plan)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy per byte; class-sharded logits (a DTensor) under ``loss_parallel``. The
    backward pass must run under ``loss_parallel`` too: call ``.backward()`` inside it."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(data: torch.Tensor, size: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, len(data) - context - 1, (size,), generator=gen)
    idx = start[:, None] + torch.arange(context + 1)
    seq = data[idx]
    return seq[:, :-1], seq[:, 1:]


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--corpus-bytes", type=int, default=8 << 20)
    p.add_argument("--optimizer", choices=["host", "adamw"], default="host")
    p.add_argument("--device-dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="the device weights' dtype under the host optimizer (its masters are fp32)")
    p.add_argument("--memory-fraction", type=float, help="CUDA: cap this process's device memory")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="operator-parallel ranks (under torchrun --nproc-per-node TP)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                   help="ZeRO over the data-parallel ranks (torchrun ranks / tp): 1 optimizer states, 2 + gradients, "
                        "3 + parameters (--optimizer adamw); with --optimizer host any stage is ZeRO-Offload: each "
                        "host keeps 1/dp of the fp32 masters and moments, gradients reduce-scattered")
    p.add_argument("--offload-ratio", type=float, default=1.0,
                   help="--optimizer host: the fraction of the parameters whose AdamW state lives and updates on the "
                        "host; the rest update on the device (under bf16 autocast; one global norm clips both parts)")
    p.add_argument("--recompute", default="none",
                   help="none; full (every block recomputes in backward); or the operator types whose outputs the "
                        "blocks keep, comma-separated (matmul, attention), recomputing the rest")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm to this")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (ranks; under torchrun with pp x tp x dp ranks)")
    p.add_argument("--schedule", default="1f1b", choices=[s.value for s in Schedule], help="pipeline schedule (--pp > 1)")
    p.add_argument("--micro-batches", type=int, default=0, help="micro-batches per batch (--pp > 1; default: pp)")
    args = p.parse_args(argv)

    PartialOffloadConfig(args.offload_ratio)  # checks the ratio before anything starts
    if args.pp > 1 and (args.offload_ratio < 1 or (args.optimizer == "host" and args.device_dtype == "fp16")):
        raise ValueError("--pp > 1 runs AdamW or the host optimizer with bf16 or fp32 device weights: drop "
                         "--offload-ratio and --device-dtype fp16 (a loss scale inside the schedule's loss is not built)")
    if args.tp > 1 and args.optimizer == "host":
        raise ValueError("--tp > 1 shards the device weights; HostAdamW keeps whole master weights: add --optimizer adamw")
    parallel.init()  # under torchrun: join the job's process group
    device = resolve_device(Target.DEVICE)
    if args.memory_fraction and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    data = stdlib_corpus(args.corpus_bytes)
    split = int(0.95 * len(data))
    train, valid = data[:split], data[split:]
    torch.manual_seed(args.seed)  # every rank builds the same full model, then keeps its shards
    model = Decoder(256, args.d_model, args.layers, args.heads, args.context).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    blocks = tuple(f"blocks.{i}" for i in range(args.layers))
    if args.pp > 1:
        return train_pipelined(args, model, train, valid, device)
    # The composition order (docs/parallel): operator sharding -> recompute -> ZeRO -> data parallel.
    mesh, rank, dp, dp_rank = None, 0, 1, 0
    if args.tp > 1 or args.zero or torch.distributed.is_initialized():
        mesh = build_mesh(MeshConfig(tp=args.tp))  # dp = torchrun ranks / tp
        rank, dp, dp_rank = torch.distributed.get_rank(), mesh[MeshDim.DP.value].size(), mesh[MeshDim.DP.value].get_local_rank()
        if args.batch_size % dp:
            raise ValueError(f"--batch-size {args.batch_size} is not a multiple of the {dp} data-parallel ranks")
        if dp > 1 and args.tp > 1 and args.zero < 2:
            raise ValueError("data x operator parallel (a 2-D mesh) needs --zero 2 or 3: DDP takes no DTensor parameters, "
                             "FSDP2 does")
        if args.tp > 1:
            tensor_parallel(model, mesh[MeshDim.TP.value], args.heads)
    recompute = RecomputeConfig()
    if args.recompute != "none":
        save = frozenset() if args.recompute == "full" else RecomputeConfig.parse_ops(args.recompute.split(","))
        recompute = RecomputeConfig(blocks, save)
    # the host optimizer shards its own state (ZeRO-Offload); FSDP2 is for device optimizers
    zero = ZeroConfig(args.zero if args.optimizer == "adamw" else 0, units=blocks)
    net = model
    if mesh is None:
        apply_recompute(model, recompute)
    else:  # after operator sharding: recompute regions of sharded ops, then FSDP2 over dp (2-D with tp)
        parallelize(model, ParallelDims.of_mesh(mesh, int(zero.stage)), ParallelPlan(recompute=recompute, zero=zero,
                                                                                    dense=None))
        if dp > 1 and args.zero < 2:
            net = DistributedDataParallel(model, process_group=mesh[MeshDim.DP.value].get_group())
    if args.optimizer == "host":
        dtype = DTYPES[args.device_dtype]
        scaler = DynamicLossScaler() if dtype is torch.float16 else None
        group = mesh[MeshDim.DP.value].get_group() if dp > 1 else None  # HostAdamW averages gradients on the hosts
        if args.offload_ratio < 1:  # partial offload: the device part keeps fp32 weights, autocast mixes them
            if args.zero or dp > 1 or dtype is torch.float16:
                raise ValueError("--offload-ratio < 1 runs in one process with bf16: drop --zero, torchrun and fp16")
            print(f"partial offload: {args.offload_ratio} of the parameters' state on the host", file=sys.stderr)
            opt = PartialOffloadAdamW(model.named_parameters(), lr=args.lr, weight_decay=0.1,
                                      config=PartialOffloadConfig(args.offload_ratio, HostOffloadConfig(device_dtype=dtype),
                                                                  max_grad_norm=args.max_grad_norm))
        else:
            # --zero with the host optimizer is ZeRO-Offload: each host keeps 1/dp of the masters and moments
            kind = ShardedHostAdamW if args.zero else HostAdamW
            opt = kind(model.named_parameters(), lr=args.lr, weight_decay=0.1, process_group=group,
                       config=HostOffloadConfig(device_dtype=dtype, max_grad_norm=args.max_grad_norm, loss_scaler=scaler))
        net = model  # no DDP: HostAdamW's host all-reduce is the data-parallel exchange
    else:
        # foreach only over one kind: tp mixes DTensor shards and replicated plain tensors
        foreach = len({isinstance(p, DTensor) for p in model.parameters()}) == 1
        opt = (zero_optimizer(model.parameters(), torch.optim.AdamW, zero, mesh, lr=args.lr, weight_decay=0.1,
                              foreach=foreach) if mesh is not None else
               torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"{n_params / 1e6:.2f} M parameters on {device}, optimizer {args.optimizer}, tp {args.tp}, dp {dp}, zero {args.zero}",
        file=sys.stderr)
    sharded = contextlib.nullcontext if args.tp == 1 else loss_parallel
    partial = isinstance(opt, PartialOffloadAdamW) and opt.device is not None and opt.host is not None
    mixed = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if partial else contextlib.nullcontext

    gen = torch.Generator().manual_seed(args.seed)
    wdtype = next(model.parameters()).dtype
    t0, losses = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        x, y = batch(train, args.batch_size, args.context, gen)  # the global batch, the same on every rank
        share = args.batch_size // dp  # this data-parallel rank's rows (the same on its tp ranks)
        x, y = (t[dp_rank * share:(dp_rank + 1) * share].to(device) for t in (x, y))
        opt.zero_grad()
        with sharded(), mixed():
            loss = lm_loss(net(x), y)
            scale = opt.loss_scale if isinstance(opt, (HostAdamW, PartialOffloadAdamW)) else 1.0
            (loss * scale).backward()
        if not isinstance(opt, (HostAdamW, PartialOffloadAdamW)):
            clip_grad_norm(model.parameters(), args.max_grad_norm)
        opt.step()
        losses.append(_value(loss, mesh if dp > 1 else None))  # sync point: the log needs the value
        if step % args.log_every == 0 or step == args.steps:
            window = losses[-args.log_every:]
            mean = sum(window) / len(window)  # loss and bits/byte of the same steps
            log(f"step {step}: train loss {mean:.4f} ({math.log2(math.e) * mean:.3f} bits/byte, mean of the last "
                f"{len(window)} steps)", flush=True)
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad(), sharded(), mixed():
        vx, vy = (t.to(device) for t in batch(valid, 32, args.context, torch.Generator().manual_seed(1)))
        val = _value(lm_loss(model(vx), vy))
    report = device_memory_report(model, opt)
    result = {
        "params": n_params, "optimizer": args.optimizer, "weights_dtype": str(wdtype).replace("torch.", ""),
        "final_train_loss": losses[-1], "valid_loss": val, "tokens_per_s": args.steps * args.batch_size * args.context / seconds,
        "device_bytes_per_param": report["bytes_per_param"], "device": str(device),
    }
    if device.type == "cuda":
        result["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
    if mesh is not None:
        result.update(tp=args.tp, dp=dp, zero=args.zero)
        result["param_bytes_per_rank"] = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    log(json.dumps(result))
    return result


def train_pipelined(args: argparse.Namespace, model: Decoder, train: torch.Tensor, valid: torch.Tensor,
                    device: torch.device) -> dict:
    """``--pp N``: the decoder split into pipeline stages over the mesh's ``pp`` ranks, then, per
    stage and in hetero's order, operator sharding (``--tp``), recompute, and ZeRO or
    replication over ``dp``; AdamW (ZeRO-1 sharded with ``--zero 1``) or HostAdamW (its masters
    sharded over ``dp`` with ``--zero``: ZeRO-Offload); one global gradient norm over every
    stage. Validation runs on the whole model, gathered from the stages."""
    mesh = build_mesh(MeshConfig(tp=args.tp, pp=args.pp))
    dp, dp_rank = mesh[MeshDim.DP.value].size(), mesh[MeshDim.DP.value].get_local_rank()
    schedule = Schedule(args.schedule)
    micro = args.micro_batches or args.pp
    if args.batch_size % (dp * micro):
        raise ValueError(f"--batch-size {args.batch_size} is not a multiple of {dp} data-parallel ranks x {micro} "
                         f"micro-batches")
    config = PipelineConfig(schedule, micro, stages_per_rank=2 if schedule.interleaved else 1)
    save = None if args.recompute == "none" else (
        frozenset() if args.recompute == "full" else RecomputeConfig.parse_ops(args.recompute.split(",")))
    zero = ZeroConfig(args.zero)

    def parallelize_stage(stage: Decoder) -> nn.Module:
        if args.tp > 1:
            tensor_parallel(stage, mesh[MeshDim.TP.value], args.heads, shard_logits=False)
        blocks = tuple(f"blocks.{k}" for k in stage.blocks)  # this stage's blocks
        if save is not None:
            apply_recompute(stage, RecomputeConfig(blocks, save))
        if args.optimizer == "host":  # its host all-reduce (or reduce-scatter) is the data-parallel exchange
            return stage
        if args.zero >= 2:
            return apply_zero(stage, ZeroConfig(args.zero, blocks), mesh)
        if dp > 1:  # DDP's bucket rebuild does not survive micro-batches; FSDP2's replicate syncs once per batch
            from torch.distributed._composable.replicate_with_fsdp import replicate

            return replicate(stage, mesh=mesh[MeshDim.DP.value])
        return stage

    pipe = pipeline(model, config, mesh, lm_loss, parallelize_stage)
    pp_group = mesh[MeshDim.PP.value].get_group()
    if args.optimizer == "host":  # micro-batch gradients summed on the device, streamed once; one norm over the stages
        kind = ShardedHostAdamW if args.zero else HostAdamW
        opt = kind(pipe.named_parameters(), lr=args.lr, weight_decay=0.1, process_group=mesh[MeshDim.DP.value].get_group(),
                   norm_group=pp_group, config=HostOffloadConfig(device_dtype=DTYPES[args.device_dtype], accumulate=micro,
                                                                 max_grad_norm=args.max_grad_norm))
    else:
        foreach = len({isinstance(p, DTensor) for p in pipe.parameters()}) == 1
        opt = zero_optimizer(pipe.parameters(), torch.optim.AdamW, zero, mesh, lr=args.lr, weight_decay=0.1,
                             foreach=foreach)
    rank = torch.distributed.get_rank()
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters on {device}, pp {args.pp} "
        f"({schedule.value}, {micro} micro-batches), tp {args.tp}, dp {dp}, zero {args.zero}", file=sys.stderr)
    gen = torch.Generator().manual_seed(args.seed)
    t0, losses, bubbles = time.perf_counter(), [], []
    for step in range(1, args.steps + 1):
        x, y = batch(train, args.batch_size, args.context, gen)
        share = args.batch_size // dp
        x, y = (t[dp_rank * share:(dp_rank + 1) * share].to(device) for t in (x, y))
        opt.zero_grad()
        loss = torch.tensor(pipe.step(x, y))  # this share's batch loss, on every rank of the pipeline
        if args.optimizer == "adamw":  # (HostAdamW clips on the host, by the same global norm)
            clip_grad_norm(pipe.parameters(), args.max_grad_norm, pp_group)
        opt.step()
        losses.append(_value(loss, mesh if dp > 1 else None))
        bubbles.append(pipe.bubble)
        if step % args.log_every == 0 or step == args.steps:
            log(f"step {step}: train loss {sum(losses[-args.log_every:]) / len(losses[-args.log_every:]):.4f}, "
                f"bubble {bubbles[-1]:.2f} (predicted {predicted_bubble(schedule, args.pp, micro, config.stages_per_rank)})",
                flush=True)
    seconds = time.perf_counter() - t0
    # the whole model from every stage (DTensor shards gathered), for validation in one piece
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
             for m in pipe.modules for k, v in m.state_dict().items()}
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, state)
    # a new whole model: the stages share (and sharded, or cast) this rank's units of ``model``
    model = Decoder(256, args.d_model, args.layers, args.heads, args.context).to(device, next(iter(state.values())).dtype)
    model.load_state_dict({k: v for part in parts for k, v in part.items()})
    model.eval()
    with torch.no_grad():
        vx, vy = (t.to(device) for t in batch(valid, 32, args.context, torch.Generator().manual_seed(1)))
        val = lm_loss(model(vx), vy).item()
    result = {"pp": args.pp, "schedule": schedule.value, "micro_batches": micro, "tp": args.tp, "dp": dp, "zero": args.zero,
              "final_train_loss": losses[-1], "valid_loss": val,
              "tokens_per_s": args.steps * args.batch_size * args.context / seconds,
              "bubble": bubbles[-1], "predicted_bubble": predicted_bubble(schedule, args.pp, micro, config.stages_per_rank),
              "device_bytes_per_param": device_memory_report(nn.ModuleList(pipe.modules), opt)["bytes_per_param"],
              "device": str(device)}
    log(json.dumps(result))
    return result


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _value(loss: torch.Tensor, mesh: DeviceMesh | None = None) -> float:
    """The loss as a float; with ``mesh``, the mean over its data-parallel ranks (equal shares)."""
    value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
    if mesh is not None:
        torch.distributed.all_reduce(value, group=mesh[MeshDim.DP.value].get_group())
        value /= mesh[MeshDim.DP.value].size()
    return value.item()


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float,
                   pipeline_group: torch.distributed.ProcessGroup | None = None) -> float:
    """Clip the global L2 norm of the gradients to ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``)
    over a mix of DTensor shards and replicated plain tensors: a shard's squares are summed over
    its mesh (``full_tensor`` of the norm), a replicated gradient counts once; with
    ``pipeline_group``, the stages' sums are added over the pipeline ranks. Returns the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    squares = [g.float().pow(2).sum() for g in grads]
    total = sum((s.full_tensor() if isinstance(s, DTensor) else s) for s in squares)  # all-reduce of the shard parts
    total = torch.as_tensor(total, dtype=torch.float32)
    if pipeline_group is not None:
        torch.distributed.all_reduce(total, group=pipeline_group)  # every stage's parameters are its own
    norm = total.sqrt()
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(factor)
    return norm.item()


if __name__ == "__main__":
    run_main(main, __file__)  # one line for hetero's and this script's own errors, the traceback otherwise
