"""Sparse optimizers for host embedding tables: they update only the rows present in the batch.

Dense (device) parameters use any ``torch.optim`` optimizer on
``hetero.embedding.dense_parameters(model)``.
"""

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
