"""Device tables' sparse optimizers: torch's own, with the update rules of :mod:`hetero.optim.sparse`.

A table a plan moves to the device (:class:`hetero.embedding.DeviceEmbedding`) has sparse
gradients (torch ``sparse_coo`` tensors of the looked-up rows) and is trained by the torch
optimizer that applies the same rule to the same rows: ``torch.optim.SparseAdam`` is LazyAdam
(moments and weights of the touched rows only, the step count per table), ``Adagrad`` and
``SGD`` take sparse gradients as they are. FTRL and row-wise Adagrad have no torch counterpart:
their tables stay on the host.
"""

from __future__ import annotations

import torch
from torch import nn

from hetero.optim.sparse import AdagradConfig, LazyAdamConfig, SGDConfig, SparseOptimizerKind

DEVICE_SPARSE_OPTIMIZERS = (SparseOptimizerKind.LAZY_ADAM, SparseOptimizerKind.ADAGRAD, SparseOptimizerKind.SGD)


def device_sparse_optimizer(kind: SparseOptimizerKind, params: list[nn.Parameter],
                            config: LazyAdamConfig | AdagradConfig | SGDConfig | None = None) -> torch.optim.Optimizer:
    """torch's optimizer applying ``kind``'s rule to device tables ``params`` (sparse gradients).

    Args:
        kind: one of :data:`DEVICE_SPARSE_OPTIMIZERS`.
        params: the device tables' weights.
        config: ``kind``'s hyperparameters (default: its config's defaults).

    Raises:
        ValueError: a kind torch has no sparse optimizer for (the table stays on the host).
    """
    if kind not in DEVICE_SPARSE_OPTIMIZERS:
        raise ValueError(f"{kind.value} has no torch optimizer for sparse gradients: keep its tables on the host "
                         f"(device tables take {[k.value for k in DEVICE_SPARSE_OPTIMIZERS]})")
    c = config if config is not None else kind.optimizer.Config()
    if kind is SparseOptimizerKind.LAZY_ADAM:
        return torch.optim.SparseAdam(params, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps)
    if kind is SparseOptimizerKind.ADAGRAD:
        return torch.optim.Adagrad(params, lr=c.lr, eps=c.eps, initial_accumulator_value=c.initial_accumulator)
    return torch.optim.SGD(params, lr=c.lr)
