"""Operator parallel on the GPT example's block: bytes per rank at tp = 1, 2, 4, and the
communication that ``hetero.explain`` predicts against what the collectives actually send.

For each tp (gloo ranks on this machine; the bytes do not depend on the backend's speed):

* parameter bytes per rank: the block's live parameter storages (DTensors: the local shard);
* activation bytes per rank: the storages autograd saves for backward in one forward pass
  (``saved_tensors_hooks``, each storage once, parameters excluded);
* communication per training step (forward + backward), counted by wrapping the collectives
  (:class:`hetero.parallel.comm.CollectiveCounter`), with the number of calls per collective;
* explain's prediction against the counted bytes, for the block's MLP branch
  ``x + proj(gelu(fc(x)))`` with ``fc`` annotated column-parallel and the rest propagated, run
  under the propagated layouts (forward).

    python benchmarks/tp_gpt_block.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, load_example, spawn_ranks  # noqa: E402



def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _storages(tensors, exclude=frozenset()) -> int:
    seen = {}
    for t in tensors:
        st = _local(t).untyped_storage()
        if st.data_ptr() not in exclude:
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class MLPBranch(nn.Module):
    """The block's MLP residual branch (the part propagation models: linear and elementwise ops)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.fc, self.proj = block.fc, block.proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.nn.functional.gelu(self.fc(x)))


def _measure(rank: int, tp: int, args: argparse.Namespace, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    torch.set_num_threads(1)
    from hetero.parallel import MeshConfig, ShardingPlan, build_mesh
    from hetero.parallel.comm import CollectiveCounter
    from hetero.parallel.propagation import propagate
    from hetero.parallel.sharding_graph import LayoutInterpreter, capture_for_sharding

    lm = load_example("lm_host_adam")
    mesh = build_mesh(MeshConfig(tp=tp))
    torch.manual_seed(0)
    block = lm.Block(args.d_model, args.heads)
    reference = MLPBranch(lm.Block(args.d_model, args.heads))  # a plain copy for the propagation run
    if tp > 1:
        lm.tensor_parallel_block(block, mesh["tp"])
    x = torch.randn(args.batch, args.context, args.d_model, requires_grad=True)
    params = {_local(p).untyped_storage().data_ptr() for p in block.parameters()}
    saved = []

    def pack(t):  # noqa: ANN001, ANN202
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), CollectiveCounter() as fwd:
        y = block(x)
    activation_bytes = _storages(saved, exclude=frozenset(params))
    saved.clear()
    with CollectiveCounter() as bwd:
        _local(y).sum().backward()
    result = {"param_bytes_per_rank": _storages(block.parameters()), "activation_bytes_per_rank": activation_bytes,
              "forward_collectives": fwd.summary(), "backward_collectives": bwd.summary(),
              "comm_bytes_per_step": fwd.total_bytes + bwd.total_bytes}
    if tp > 1:
        plan = ShardingPlan().module("fc", ((1, 1, 1), (1, tp)))
        xs = torch.randn(args.batch, args.context, args.d_model)
        gm, strategies = capture_for_sharding(reference, (xs,), plan)
        predicted = propagate(gm, strategies, tuple(mesh.shape), all_to_all=False)  # gloo has no all-to-all
        with CollectiveCounter() as run:
            got = LayoutInterpreter(gm, predicted, mesh).run(xs)
        with torch.no_grad():
            err = (got.full_tensor() - reference(xs)).abs().max().item()
        result["mlp_branch"] = {"predicted_bytes": predicted.total_bytes, "counted_bytes": run.total_bytes,
                                "predicted": [f"{a}->{b}: " + "+".join(c.value for c in calls)
                                              for a, b, _, _, _, calls in predicted.redistributions],
                                "counted": [c.kind.value for c in run.calls], "max_abs_error": err}
    if rank == 0:
        out.update(result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    args = p.parse_args()
    result = {"d_model": args.d_model, "heads": args.heads, "batch": args.batch, "context": args.context, "dtype": "float32"}
    for tp in (1, 2, 4):
        result[f"tp{tp}"] = spawn_ranks(_measure, tp, args)
        r = result[f"tp{tp}"]
        print(f"tp {tp}: params {r['param_bytes_per_rank'] / 1e6:.2f} MB, activations "
              f"{r['activation_bytes_per_rank'] / 1e6:.2f} MB, comm {r['comm_bytes_per_step'] / 1e6:.2f} MB per rank and step",
              file=sys.stderr)
    for tp in (2, 4):
        r = result[f"tp{tp}"]
        result[f"param_bytes_ratio_tp{tp}"] = r["param_bytes_per_rank"] / result["tp1"]["param_bytes_per_rank"]
        result[f"activation_bytes_ratio_tp{tp}"] = r["activation_bytes_per_rank"] / result["tp1"]["activation_bytes_per_rank"]
        result[f"explain_predicted_over_counted_tp{tp}"] = r["mlp_branch"]["predicted_bytes"] / r["mlp_branch"]["counted_bytes"]
    emit("tp_gpt_block", result)


if __name__ == "__main__":
    main()
