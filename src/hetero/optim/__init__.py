"""Host optimizers: sparse ones for embedding tables (only the rows present in the batch), and
HostAdam/HostAdamW for dense models (fp32 master weights and moments on the host).

Dense (device) parameters use any ``torch.optim`` optimizer on
``hetero.embedding.dense_parameters(model)``.
"""

from hetero.optim.accounting import device_memory_report
from hetero.optim.device_sparse import DEVICE_SPARSE_OPTIMIZERS, device_sparse_optimizer
from hetero.optim.host_adam import HostAdam, HostAdamW
from hetero.optim.host_state import HostOffloadConfig
from hetero.optim.host_adam_sharded import ShardedHostAdamW
from hetero.optim.loss_scale import DynamicLossScaler
from hetero.optim.sparse import (
    FTRL,
    SGD,
    Adagrad,
    AdagradConfig,
    FTRLConfig,
    LazyAdam,
    LazyAdamConfig,
    RowWiseAdagrad,
    RowWiseAdagradConfig,
    SGDConfig,
    SparseOptimizer,
    SparseOptimizerKind,
)

__all__ = [
    "DEVICE_SPARSE_OPTIMIZERS",
    "device_sparse_optimizer",
    "DynamicLossScaler",
    "HostAdam",
    "HostAdamW",
    "HostOffloadConfig",
    "ShardedHostAdamW",
    "device_memory_report",
    "FTRL",
    "SGD",
    "Adagrad",
    "AdagradConfig",
    "FTRLConfig",
    "LazyAdam",
    "LazyAdamConfig",
    "RowWiseAdagrad",
    "RowWiseAdagradConfig",
    "SGDConfig",
    "SparseOptimizer",
    "SparseOptimizerKind",
]
