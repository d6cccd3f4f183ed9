"""hetero: train PyTorch models that do not fit on the accelerator.

What is huge and light on compute (embedding tables, their sparse optimizer state) lives on the
host; what is compute-dense runs on the device. ``import hetero`` stays light: no native kernels
and no GPU initialisation happen at import time.
"""

from hetero.embedding import HostEmbedding, HostEmbeddingCollection, Pooling, TableConfig
from hetero.placement import StorageTier, Target, resolve_device

__version__ = "0.1.0"


def __getattr__(name: str):
    # hetero.explain / partition / plan / apply load torch.fx and the planner on first use only.
    if name == "explain":
        from hetero.report import explain

        return explain
    if name == "partition":
        from hetero.placement.partitioner import partition

        return partition
    if name == "plan":
        from hetero.planner.planner import plan

        return plan
    if name == "apply":
        from hetero.planner.apply import apply

        return apply
    raise AttributeError(f"module 'hetero' has no attribute {name!r}")

__all__ = [
    "HostEmbedding",
    "apply",
    "explain",
    "partition",
    "plan",
    "HostEmbeddingCollection",
    "Pooling",
    "StorageTier",
    "TableConfig",
    "Target",
    "resolve_device",
]
