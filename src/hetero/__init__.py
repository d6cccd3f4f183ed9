"""hetero: train PyTorch models that do not fit on the accelerator.

What is huge and light on compute (embedding tables, their sparse optimizer state) lives on the
host; what is compute-dense runs on the device. ``import hetero`` compiles no native kernel and
initialises no GPU (numba's kernels compile on first call).
"""

from hetero.embedding import HostEmbedding, HostEmbeddingCollection, Pooling, TableConfig
from hetero.placement import StorageTier, Target, resolve_device
from hetero.placement.partitioner import partition
from hetero.planner.apply import apply
from hetero.planner.planner import plan
from hetero.planner.table_plan import SparseRule, TablePlan
from hetero.report import explain

__version__ = "0.1.0"

__all__ = [
    "HostEmbedding",
    "apply",
    "explain",
    "partition",
    "plan",
    "HostEmbeddingCollection",
    "Pooling",
    "SparseRule",
    "StorageTier",
    "TableConfig",
    "TablePlan",
    "Target",
    "resolve_device",
]
