"""Which of torch's optimizer implementations a dense device optimizer uses.

On CUDA, torch's default is ``foreach``: a few kernels over all the tensors, and temporaries the
size of the parameters (AdamW's square root of the second moments is one), so the step's peak is
a parameter-sized copy above the state that the planner prices. The ``fused`` kernels update in one
pass with no such temporaries and are the fastest (torchtitan's default for AdamW). They take plain
CUDA tensors of floating dtypes; DTensor shards (tensor parallelism) keep torch's default.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def fused_on_cuda(params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """``{"fused": True}`` where every tensor of ``params`` is a plain floating-point CUDA tensor
    (torch's ``fused`` argument of ``Adam``, ``AdamW`` and ``SGD``), else ``{}`` (torch's default:
    ``foreach`` on CUDA, the per-tensor loop on the CPU). Reads only the tensors' metadata."""
    params = list(params)
    if params and all(p.device.type == "cuda" and p.is_floating_point() and not isinstance(p, DTensor) for p in params):
        return {"fused": True}
    return {}
