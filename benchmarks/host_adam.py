"""Host AdamW step throughput (params/s) against torch's fused AdamW and the memory bound.

Same run, same machine: (1) HostAdamW's host update with the bf16 copy-out for the device, from
gradients already in its host buffers (bf16, as bf16 device weights produce them); (2) ``torch.optim.AdamW(fused=True)`` on fp32 CPU
tensors (no copy-out); (3) the bandwidth bound: the best of a copy and a STREAM triad
(``a = b + s * c``) measured on large arrays, divided by 28 bytes per parameter (read weight,
two moments, gradient; write weight, two moments). Sizes: one 100M-parameter tensor and ten
10M-parameter tensors. Also reports HostAdamW's device bytes per parameter, and the sharded case
(ZeRO-Offload, ``ShardedHostAdamW`` on 2 gloo ranks of this machine): each rank's update rate
over its 1/N, the reduce-scatter and all-gather included, against one process's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, spawn_ranks  # noqa: E402

from hetero.optim import HostAdamW, device_memory_report  # noqa: E402

BYTES_PER_PARAM = 28


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bandwidth(n: int, repeats: int) -> dict[str, float]:
    a, b, c = (torch.rand(n) for _ in range(3))
    copy_s = median_time(lambda: a.copy_(b), repeats)
    triad_s = median_time(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    return {"copy_bytes_per_s": 8 * n / copy_s, "triad_bytes_per_s": 12 * n / triad_s}


def host_adamw_rate(shapes: list[int], repeats: int) -> tuple[float, float]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in shapes]
    opt = HostAdamW([(f"p{i}", p) for i, p in enumerate(params)], lr=1e-3)  # bf16 device copies
    for p in params:
        opt.grad_buffer(p).copy_(torch.randn(p.numel()))
    seconds = median_time(opt.update_from_host_gradients, repeats)
    per_param = device_memory_report(torch.nn.ParameterList(params), opt)["bytes_per_param"]
    return sum(shapes) / seconds, per_param


def torch_fused_rate(shapes: list[int], repeats: int) -> float:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in shapes]
    for p in params:
        p.grad = torch.randn(p.numel())
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    return sum(shapes) / median_time(opt.step, repeats)


def _sharded_rank(rank: int, n: int, shapes: list[int], repeats: int, port: int, out: dict) -> None:  # spawn_ranks
    import os

    import torch.distributed as dist

    from hetero.optim import ShardedHostAdamW

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(max(1, torch.get_num_threads() // n))
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(k)) for k in shapes]
    opt = ShardedHostAdamW([(f"p{i}", p) for i, p in enumerate(params)], lr=1e-3)  # bf16 device copies
    for p in params:
        opt.grad_buffer(p)[: p.numel()].copy_(torch.randn(p.numel()))
    dist.barrier()
    seconds = median_time(opt.update_from_host_gradients, repeats)  # reduce-scatter, update, all-gather
    slots = list(opt._slots.values())

    def update_only() -> None:  # the fused kernel over this rank's shards: no exchange
        for slot in slots:
            opt._adam_step(slot, slot.shard[: slot.master.numel()], 1.0)

    dist.barrier()  # the ranks update at the same time, sharing this host's memory bandwidth
    update = median_time(update_only, repeats)
    rates = torch.tensor([sum(sl.master.numel() for sl in slots) / update, update])
    dist.all_reduce(rates)
    if rank == 0:
        out.update(seconds=seconds, host_rate=float(rates[0]), update_seconds=float(rates[1]) / n)
    dist.barrier()
    dist.destroy_process_group()


def sharded_rates(shapes: list[int], n: int, repeats: int) -> dict[str, float]:
    """ShardedHostAdamW on ``n`` gloo ranks of this machine, in parameters per second: each
    rank's step (its 1/n of every parameter, the exchange included), each rank's update alone
    (the fused kernel on its shards), and the update rate of all ranks together (this host's)."""
    got = spawn_ranks(_sharded_rank, n, shapes, repeats)
    return {"step_per_rank": sum(shapes) / n / got["seconds"], "update_per_rank": sum(shapes) / n / got["update_seconds"],
            "update_all_ranks_on_this_host": got["host_rate"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=int, default=100_000_000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--sharded-params", type=int, default=20_000_000, help="parameters of the sharded (ZeRO-Offload) case")
    p.add_argument("--sharded-only", action="store_true", help="only the sharded case (results/host_adam_sharded_*.json)")
    args = p.parse_args()
    n = args.params
    result: dict = {}
    # ZeRO-Offload first, before the large arrays below exist (the spawned ranks measured 6x
    # slower after them). Each rank updates 1/N; the claim is a per-host update rate close to one
    # process's (the update is memory-bound). With one rank per host that is each rank's rate;
    # here the N ranks share one host's cores and memory bandwidth, so the comparable number is
    # the N ranks' rate together - and the exchange runs over gloo's TCP loopback.
    shapes = [args.sharded_params // 10] * 10
    rates = sharded_rates(shapes, 2, args.repeats)
    single, _ = host_adamw_rate(shapes, args.repeats)
    result["sharded_params"] = args.sharded_params
    result["single_process_update_params_per_s"] = single
    for key, rate in rates.items():
        result[f"sharded_2_ranks_{key}_params_per_s"] = rate
    result["sharded_2_ranks_host_update_over_single_process"] = rates["update_all_ranks_on_this_host"] / single
    result["sharded_2_ranks_step_per_rank_over_single_process"] = rates["step_per_rank"] / single
    print(f"sharded over 2 ranks on this host: update {rates['update_all_ranks_on_this_host'] / 1e6:.0f} M/s for the "
          f"host ({rates['update_per_rank'] / 1e6:.0f} M/s per rank), step with exchange {rates['step_per_rank'] / 1e6:.0f}"
          f" M/s per rank; one process {single / 1e6:.0f} M/s", file=sys.stderr)
    if args.sharded_only:
        emit("host_adam_sharded", result)
        return
    bw = bandwidth(n, args.repeats)
    bound = max(bw.values()) / BYTES_PER_PARAM
    result.update({"params": n, **bw, "bandwidth_bound_params_per_s": bound})
    for label, shapes in (("", [n]), ("_10x", [n // 10] * 10)):
        mine, per_param = host_adamw_rate(shapes, args.repeats)
        theirs = torch_fused_rate(shapes, args.repeats)
        result[f"host_adamw_params_per_s{label}"] = mine
        result[f"torch_fused_adamw_params_per_s{label}"] = theirs
        result[f"host_adamw_fraction_of_bound{label}"] = mine / bound
        result[f"host_adamw_speedup_vs_torch_fused{label}"] = mine / theirs
        print(f"{label or '1x'}: host {mine / 1e6:.0f} M/s, torch fused {theirs / 1e6:.0f} M/s, bound {bound / 1e6:.0f} M/s",
              file=sys.stderr)
    result["device_bytes_per_param"] = per_param
    emit("host_adam", result)


if __name__ == "__main__":
    main()
