"""One system's embedding step, measured in this process; ``run.py`` starts one process per
measurement (each system in its own environment: hetero's, or the peers' of ``requirements.txt``).

The workload (issue #39's table): ``T`` = 26 tables of ``--rows`` x 16 fp32 rows, batches of 4096
samples with one id per table, the same ids in every system (``_workload.id_arrays``); a step is
the forward lookup, the backward with a fixed upstream gradient and the optimizer's update
(fused into the backward for FBGEMM and TorchRec, as they run it). ``--pooled``: bags of one id
summed (``(B, 1)`` ids, ``Pooling.SUM``); else per-id lookups (``Pooling.NONE``,
``PoolingMode.NONE``). Prints one JSON line: ``{"system", "optimizer", "samples_per_s", ...}``.

Systems: ``hetero`` (a ``HostEmbeddingCollection``, one fused kernel call per step);
``fbgemm`` (``SplitTableBatchedEmbeddingBagsCodegen`` on the CPU, fbgemm-gpu-cpu); ``torchrec``
(``FusedEmbeddingBagCollection`` over a ``KeyedJaggedTensor``); ``torch`` (26
``nn.EmbeddingBag(sparse=True)`` and ``torch.optim.SparseAdam``: LazyAdam's baseline).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _workload import id_arrays, serve, timed  # noqa: E402

T, B, D = 26, 4096, 16
LR, EPS = 0.01, 1e-8


def hetero_step(optimizer: str, rows: int, pooled: bool):  # noqa: ANN201 - step(ids)
    from hetero.embedding import HostEmbeddingCollection, Pooling, TableConfig
    from hetero.optim import SparseOptimizerKind

    pooling = Pooling.SUM if pooled else Pooling.NONE
    coll = HostEmbeddingCollection([TableConfig(f"C{i}", rows, D, pooling=pooling) for i in range(T)])
    kind = SparseOptimizerKind(optimizer)
    extra = {"eps": EPS} if "adagrad" in optimizer else {}
    opt = kind.optimizer(coll.tables.values(), kind.optimizer.Config(lr=LR, **extra))
    upstream = [torch.randn(B, D)] * T

    def step(ids: torch.Tensor) -> None:
        opt.zero_grad()
        out = coll({f"C{i}": ids[:, i : i + 1] if pooled else ids[:, i] for i in range(T)})
        torch.autograd.backward(list(out.values()), upstream)
        opt.step()

    return step


def _fbgemm_optimizer(optimizer: str):  # noqa: ANN202 - an EmbOptimType
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return {"rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
            "sgd": EmbOptimType.EXACT_SGD}[optimizer]


def fbgemm_step(optimizer: str, rows: int, pooled: bool):  # noqa: ANN201
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(rows, D, EmbeddingLocation.HOST, ComputeDevice.CPU)] * T,
        optimizer=_fbgemm_optimizer(optimizer), learning_rate=LR, eps=EPS,
        pooling_mode=PoolingMode.SUM if pooled else PoolingMode.NONE)
    offsets = torch.arange(0, T * B + 1)  # table-major bags of one id
    upstream = torch.randn(B, T * D) if pooled else torch.randn(T * B, D)

    def step(ids: torch.Tensor) -> None:
        tbe(ids.t().reshape(-1), offsets).backward(upstream)  # (the update runs inside the backward)

    return step


def torchrec_step(optimizer: str, rows: int, pooled: bool):  # noqa: ANN201
    import torchrec.optim as trec_optim
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if not pooled:
        raise ValueError("torchrec's FusedEmbeddingBagCollection pools: run it --pooled")
    kind = {"rowwise_adagrad": trec_optim.RowWiseAdagrad, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[optimizer]
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=D, num_embeddings=rows, feature_names=[f"f{i}"])
              for i in range(T)]
    kwargs = {"lr": LR, **({"eps": EPS} if optimizer != "sgd" else {})}
    ebc = FusedEmbeddingBagCollection(tables=tables, optimizer_type=kind, optimizer_kwargs=kwargs,
                                      device=torch.device("cpu"))
    keys, lengths = [f"f{i}" for i in range(T)], torch.ones(T * B, dtype=torch.int64)
    upstream = torch.randn(B, T * D)

    def step(ids: torch.Tensor) -> None:
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids.t().reshape(-1), lengths=lengths)
        ebc(kjt).values().backward(upstream)

    return step


def torch_step(optimizer: str, rows: int, pooled: bool):  # noqa: ANN201
    if optimizer != "lazy_adam":
        raise ValueError("the torch baseline is SparseAdam: --optimizer lazy_adam")
    bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(rows, D, mode="sum", sparse=True) for _ in range(T))
    opt = torch.optim.SparseAdam(bags.parameters(), lr=LR)
    upstream = [torch.randn(B, D)] * T

    def step(ids: torch.Tensor) -> None:
        opt.zero_grad()
        torch.autograd.backward([bags[i](ids[:, i : i + 1]) for i in range(T)], upstream)
        opt.step()

    return step


SYSTEMS = {"hetero": hetero_step, "fbgemm": fbgemm_step, "torchrec": torchrec_step, "torch": torch_step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    p.add_argument("--optimizer", choices=["rowwise_adagrad", "adagrad", "sgd", "lazy_adam"], required=True)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dist", choices=["uniform", "zipf"], default="uniform")
    p.add_argument("--pooled", action="store_true")
    p.add_argument("--both", action="store_true", help="hetero only: pooled bags of one and per-id lookups in this "
                   "one process, alternating step by step (their ratio without the noise between processes)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--serve", action="store_true", help="time blocks of steps as stdin asks (_workload.serve)")
    args = p.parse_args()
    torch.manual_seed(0)
    batches = [torch.from_numpy(a) for a in id_arrays(args.dist, args.rows, args.warmup + args.steps, (B, T))]
    if args.both:
        steps = {"pooled": hetero_step(args.optimizer, args.rows, True), "per_id": hetero_step(args.optimizer, args.rows, False)}
        times: dict[str, list[float]] = {k: [] for k in steps}
        for i, ids in enumerate(batches):
            for k, step in steps.items():
                t0 = time.perf_counter()
                step(ids)
                if i >= args.warmup:
                    times[k].append(time.perf_counter() - t0)
        rates = {k: B / statistics.median(v) for k, v in times.items()}
        print(json.dumps({"system": "hetero", "optimizer": args.optimizer, "dist": args.dist, **{
            f"{k}_samples_per_s": v for k, v in rates.items()}, "per_id_over_pooled": rates["per_id"] / rates["pooled"]}))
        return
    step = SYSTEMS[args.system](args.optimizer, args.rows, args.pooled)
    if args.serve:
        return serve(step, batches, args.warmup)
    seconds = timed(step, batches, args.warmup)
    print(json.dumps({"system": args.system, "optimizer": args.optimizer, "pooled": args.pooled, "dist": args.dist,
                      "samples_per_s": B / seconds, "threads": torch.get_num_threads(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
