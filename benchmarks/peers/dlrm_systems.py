"""One system's DLRM training step, measured in this process; ``run.py --model dlrm`` starts one
process per measurement (hetero's and the dense part's in hetero's environment, TorchRec's in the
peers' of ``requirements.txt``).

The model (issue #39's table): the reference implementation's Criteo Kaggle shape
(facebookresearch/dlrm): 13 dense features, bottom MLP 512-256-64-16, 26 tables of ``--rows`` x 16
with row-wise Adagrad, dot interaction, top MLP 512-256-1, Adam on the dense part; batches of 4096
with one id per table, the same ids and dense inputs in every system (``_workload.id_arrays``).
A step is the forward, the loss, the backward and both optimizers' updates, ending when the host
has the loss. Prints one JSON line: ``{"system", "samples_per_s", ...}``.

Systems: ``hetero`` (``hetero.models.dlrm.DLRM`` with host tables, ``benchmarks/dlrm_step.py``'s
model); ``dense`` (the same model whose embeddings are fixed tensors: the dense part alone);
``torchrec`` (``torchrec.models.dlrm.DLRM`` over a ``FusedEmbeddingBagCollection``, whose row-wise
Adagrad runs inside the backward, as TorchRec runs it); ``torchrec_on_hetero`` (that model after
``hetero.torchrec.shard_modules``: the same code, hetero's tables) and ``torchrec_on_hetero_ssd``
(on the SSD tier, a tenth of the rows cached); ``torchrec_dense_part`` (TorchRec's model with its
sparse arch's output fixed: its dense part alone).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _workload import id_arrays, serve, timed  # noqa: E402

T, B, D, K = 26, 4096, 16, 13
BOTTOM, TOP = [512, 256, 64, D], [512, 256, 1]
LR, EPS = 0.01, 1e-8


def batches(dist: str, rows: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(ids (B, T) int64, dense (B, K) float32, labels (B,) float32)``, the same in every process."""
    g = torch.Generator().manual_seed(1)
    return [(torch.from_numpy(a), torch.randn(B, K, generator=g), torch.randint(0, 2, (B,), generator=g).float())
            for a in id_arrays(dist, rows, count, (B, T))]


def hetero_step(rows: int, dense_only: bool):  # noqa: ANN201 - step(batch)
    import dlrm_step  # (hetero's benchmark: its model, with or without tables)

    _, step = dlrm_step.build(rows, dense_only)
    return lambda b: step(({f"C{i}": b[0][:, i] for i in range(T)}, b[1], b[2]))


def torchrec_dlrm(rows: int) -> torch.nn.Module:
    """TorchRec's own DLRM over a ``FusedEmbeddingBagCollection`` with row-wise Adagrad."""
    import torchrec.optim as trec_optim
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=D, num_embeddings=rows, feature_names=[f"C{i}"])
              for i in range(T)]
    ebc = FusedEmbeddingBagCollection(tables=tables, optimizer_type=trec_optim.RowWiseAdagrad,
                                      optimizer_kwargs={"lr": LR, "eps": EPS}, device=torch.device("cpu"))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=K, dense_arch_layer_sizes=BOTTOM,
                over_arch_layer_sizes=TOP)


def torchrec_on_hetero(rows: int, ssd: bool) -> torch.nn.Module:
    """The same TorchRec model on hetero's tables (``hetero.torchrec.shard_modules``): in host
    memory, or on the SSD tier with a tenth of the rows cached (a store under the system's temp dir)."""
    import tempfile

    import hetero.torchrec as ht
    from hetero.placement import StorageTier
    from hetero.storage import SsdConfig

    plan = ht.TablePlan()
    if ssd:  # a record is a row and its row-wise Adagrad state (D + 1 floats)
        plan = ht.TablePlan(memory=StorageTier.SSD, ssd=SsdConfig(directory=tempfile.mkdtemp(prefix="hetero-ssd-"),
                                                                 cache_bytes=T * rows // 10 * (D + 1) * 4))
    return ht.shard_modules(torchrec_dlrm(rows), plan)


class _FixedSparse(torch.nn.Module):
    """TorchRec's sparse arch replaced by its output for a batch, fixed (a leaf taking a gradient):
    the model's dense part alone, the bound on what any table engine can gain on the whole step."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.register_buffer("values", torch.randn(B, T, D) * 0.01)

    def forward(self, features) -> torch.Tensor:  # noqa: ANN001 - the KJT, unused
        return self.values.detach().requires_grad_()  # (a fresh leaf: its gradient computed, then let go)


def torchrec_dense_part(rows: int) -> torch.nn.Module:
    model = torchrec_dlrm(1)  # (one row a table: the tables are not used)
    model.sparse_arch = _FixedSparse(rows)
    return model


def torchrec_step(rows: int, dense_only: bool, model: torch.nn.Module | None = None):  # noqa: ANN201
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    model = model if model is not None else torchrec_dlrm(rows)
    dense = torch.optim.Adam([p for n, p in model.named_parameters() if "embedding_bag_collection" not in n], lr=1e-3)
    keys, lengths = [f"C{i}" for i in range(T)], torch.ones(T * B, dtype=torch.int64)

    def step(b) -> float:  # noqa: ANN001
        ids, x, y = b
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids.t().reshape(-1), lengths=lengths)
        dense.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x, kjt).squeeze(-1), y)
        loss.backward()  # (the tables' update runs inside it)
        dense.step()
        return loss.item()

    return step


SYSTEMS = {"hetero": lambda rows: hetero_step(rows, False), "dense": lambda rows: hetero_step(rows, True),
           "torchrec": lambda rows: torchrec_step(rows, False),
           "torchrec_on_hetero": lambda rows: torchrec_step(rows, False, torchrec_on_hetero(rows, False)),
           "torchrec_on_hetero_ssd": lambda rows: torchrec_step(rows, False, torchrec_on_hetero(rows, True)),
           "torchrec_dense_part": lambda rows: torchrec_step(rows, False, torchrec_dense_part(rows))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dist", choices=["uniform", "zipf"], default="uniform")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--serve", action="store_true", help="time blocks of steps as stdin asks (_workload.serve)")
    args = p.parse_args()
    step = SYSTEMS[args.system](args.rows)
    if args.serve:
        return serve(step, batches(args.dist, args.rows, args.warmup + args.steps), args.warmup)
    seconds = timed(step, batches(args.dist, args.rows, args.warmup + args.steps), args.warmup)
    print(json.dumps({"system": args.system, "model": "dlrm", "dist": args.dist, "samples_per_s": B / seconds,
                      "threads": torch.get_num_threads(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
