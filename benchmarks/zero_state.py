"""ZeRO stages on the GPT example: optimizer-state and parameter bytes per rank at N = 1, 2, 4
data-parallel ranks (gloo on this machine), counted from the live tensors after two AdamW steps
(DTensors: the local shard; each storage once); "offload" is ShardedHostAdamW (ZeRO-Offload:
its fp32 masters and moments on the host).

    python benchmarks/zero_state.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, load_example, spawn_ranks  # noqa: E402



def _measure(rank: int, n: int, stage: int | str, args: argparse.Namespace, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(1)
    from torch.nn.parallel import DistributedDataParallel

    from hetero.optim.host_state import storage_bytes
    from hetero.parallel import MeshConfig, build_mesh
    from hetero.parallel.zero import ZeroConfig, apply_zero, zero_optimizer

    lm = load_example("lm_host_adam")
    mesh = build_mesh(MeshConfig())
    torch.manual_seed(0)
    if stage == "offload":  # ZeRO-Offload: ShardedHostAdamW's masters and moments on this host
        from hetero.optim import HostOffloadConfig, ShardedHostAdamW

        model = lm.Decoder(256, args.d_model, args.layers, args.heads, args.context)
        opt = ShardedHostAdamW(model.named_parameters(), lr=1e-3, config=HostOffloadConfig(device_dtype=torch.float32))
        x = torch.randint(0, 256, (2, args.context))
        for _ in range(2):
            opt.zero_grad()
            lm.lm_loss(model(x), x).backward()
            opt.step()
        state = [t for s in opt._slots.values() for t in (s.master, s.exp_avg, s.exp_avg_sq)]
        if rank == 0:
            out.update({"optimizer_state_bytes_per_rank": storage_bytes(state),
                        "param_bytes_per_rank": storage_bytes(model.parameters())})
        dist.barrier()
        dist.destroy_process_group()
        return
    config = ZeroConfig(stage, units=tuple(f"blocks.{i}" for i in range(args.layers)))
    model = apply_zero(lm.Decoder(256, args.d_model, args.layers, args.heads, args.context), config, mesh)
    net = DistributedDataParallel(model) if stage < 2 and n > 1 else model
    opt = zero_optimizer(model.parameters(), torch.optim.AdamW, config, mesh, lr=1e-3)
    x = torch.randint(0, 256, (2, args.context))
    for _ in range(2):
        opt.zero_grad()
        lm.lm_loss(net(x), x).backward()
        opt.step()
    inner = opt.optim if hasattr(opt, "optim") else opt  # ZeroRedundancyOptimizer wraps the local one
    state = [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    if rank == 0:
        out.update({"optimizer_state_bytes_per_rank": storage_bytes(state),
                    "param_bytes_per_rank": storage_bytes(model.parameters())})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    args = p.parse_args()
    result: dict = {"d_model": args.d_model, "layers": args.layers, "optimizer": "AdamW fp32", "device": "cpu (host)"}
    for stage in (1, 2, 3, "offload"):
        for n in (1, 2, 4):
            result[f"stage{stage}_n{n}"] = spawn_ranks(_measure, n, stage, args)
            r = result[f"stage{stage}_n{n}"]
            print(f"stage {stage}, {n} ranks: optimizer state {r['optimizer_state_bytes_per_rank'] / 1e6:.2f} MB, "
                  f"parameters {r['param_bytes_per_rank'] / 1e6:.2f} MB per rank", file=sys.stderr)
        for n in (2, 4):
            result[f"stage{stage}_state_ratio_n{n}"] = (result[f"stage{stage}_n{n}"]["optimizer_state_bytes_per_rank"]
                                                       / result[f"stage{stage}_n1"]["optimizer_state_bytes_per_rank"])
    emit("zero_state", result)


if __name__ == "__main__":
    main()
