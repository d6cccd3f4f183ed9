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
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hetero.cli import run_main
from hetero.optim import DynamicLossScaler, HostAdamW, HostOffloadConfig, device_memory_report
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


class Decoder(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        mask = self.causal[:t, :t].to(h.dtype)
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


def batch(data: torch.Tensor, size: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, len(data) - context - 1, (size,), generator=gen)
    idx = start[:, None] + torch.arange(context + 1)
    seq = data[idx]
    return seq[:, :-1], seq[:, 1:]


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
    p.add_argument("--device-dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--memory-fraction", type=float, help="CUDA: cap this process's device memory")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    device = resolve_device(Target.DEVICE)
    if args.memory_fraction and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    data = stdlib_corpus(args.corpus_bytes)
    split = int(0.95 * len(data))
    train, valid = data[:split], data[split:]
    torch.manual_seed(args.seed)
    model = Decoder(256, args.d_model, args.layers, args.heads, args.context).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.optimizer == "host":
        dtype = torch.bfloat16 if args.device_dtype == "bf16" else torch.float16
        scaler = DynamicLossScaler() if dtype is torch.float16 else None
        opt = HostAdamW(model.named_parameters(), lr=args.lr, weight_decay=0.1,
                        config=HostOffloadConfig(device_dtype=dtype, max_grad_norm=1.0, loss_scaler=scaler))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    print(f"{n_params / 1e6:.2f} M parameters on {device}, optimizer {args.optimizer}", file=sys.stderr)

    gen = torch.Generator().manual_seed(args.seed)
    wdtype = next(model.parameters()).dtype
    t0, losses = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in batch(train, args.batch_size, args.context, gen))
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        scale = opt.loss_scale if isinstance(opt, HostAdamW) else 1.0
        (loss * scale).backward()
        if not isinstance(opt, HostAdamW):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())  # sync point: the log needs the value
        if step % args.log_every == 0 or step == args.steps:
            window = losses[-args.log_every:]
            mean = sum(window) / len(window)  # loss and bits/byte of the same steps
            print(f"step {step}: train loss {mean:.4f} ({math.log2(math.e) * mean:.3f} bits/byte, mean of the last "
                  f"{len(window)} steps)", flush=True)
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        vx, vy = (t.to(device) for t in batch(valid, 32, args.context, torch.Generator().manual_seed(1)))
        val = F.cross_entropy(model(vx).float().reshape(-1, 256), vy.reshape(-1)).item()
    report = device_memory_report(model, opt)
    result = {
        "params": n_params, "optimizer": args.optimizer, "weights_dtype": str(wdtype).replace("torch.", ""),
        "final_train_loss": losses[-1], "valid_loss": val, "tokens_per_s": args.steps * args.batch_size * args.context / seconds,
        "device_bytes_per_param": report["bytes_per_param"], "device": str(device),
    }
    if device.type == "cuda":
        result["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    run_main(main, __file__)  # one line for hetero's and this script's own errors, the traceback otherwise
