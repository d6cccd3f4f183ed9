"""Gradient capture: how a lookup's gradient reaches its group as a :class:`SparseGrad`.

On a device (CUDA) the lookup's unique rows are a leaf of autograd; ``F.embedding_bag``'s
backward coalesces their gradient and :func:`capture_device_grad` copies it to pinned host memory.
Where the device is the host, :class:`HostPool` pools with the numba kernels and its backward keeps
the gradient per id, so the optimizer coalesces and updates in one pass. Both run inside
backward, on autograd's thread; the optimizer step takes the result from ``group.pending``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from hetero.embedding.exchange import RowSpace
from hetero.embedding.grad import PendingGrads, SparseGrad
from hetero.embedding.kernels import kernels
from hetero.placement.tagging import TARGET
from hetero.embedding.plan import LookupPlan
from hetero.placement.target import Target


class CaptureGroup(Protocol):
    """What gradient capture reads of a table group (a :class:`~hetero.embedding.group.TableGroup`)."""

    pending: PendingGrads  # this step's sparse gradients, until the optimizer steps

    def pool_and_dedup(self, plan: LookupPlan, out: Tensor) -> None: ...


def capture_device_grad(group: CaptureGroup, unique: Tensor, grad: Tensor) -> None:
    """The hook on a device lookup's unique rows: their coalesced gradient ``grad`` (``(U, D)``,
    any device) becomes the group's pending :class:`SparseGrad` (group rows ``unique``)."""
    # Runs inside backward; ``grad`` is coalesced per unique row already.
    if grad.device.type == "cuda":
        rows = torch.empty(grad.shape, dtype=torch.float32, pin_memory=True)
        rows.copy_(grad, non_blocking=True)  # device -> host into pinned memory, async
        ready = torch.cuda.Event()
        ready.record()
        group.pending.add(SparseGrad(unique, rows, RowSpace.GROUP, ready))
    else:
        group.pending.add(SparseGrad(unique, grad.detach().to(torch.float32), RowSpace.GROUP))


class HostPool(torch.autograd.Function):
    """Pool (or expand) unique rows into bags on the CPU with the numba kernels.

    The backward hands the group a :class:`SparseGrad` that keeps the gradient per id; the
    optimizer coalesces it into one row per unique id as it updates (no gradient flows to
    ``rows``, which is a copy). On CUDA, ``F.embedding_bag``'s backward coalesces on the device.
    Its autograd node is marked as host work (:mod:`hetero.placement.tagging`): the table's
    backward is the host's, whatever thread runs it.
    """

    @staticmethod
    def forward(ctx, rows, index, offsets, scale, sink, group, plan):
        bags = offsets.numel() - 1 if offsets.numel() else index.numel()
        out = torch.empty(bags, rows.shape[1], dtype=torch.float32)
        if plan.unique is None and sink.requires_grad:  # rows is the fp32 table, index the ids: dedup as it pools
            group.pool_and_dedup(plan, out)  # (without grad, e.g. evaluation, nothing needs the dedup: pool only)
        else:
            scale_np = scale.numpy() if scale is not None else np.empty(0, np.float32)
            kernels().pool_forward(rows.detach().float().numpy(), index.numpy(), offsets.numpy(), scale_np, out.numpy())
        ctx.group, ctx.plan = group, plan  # index tensors only: nothing autograd needs to version-check
        ctx.metadata[TARGET] = Target.HOST.value
        # One output a request (fp32 whatever the storage dtype: the backward then receives fp32
        # gradients), each over its part of ``out`` but not a view of it (LookupPlan.outputs).
        return plan.outputs(out)

    @staticmethod
    def backward(ctx, *grads):
        plan = ctx.plan
        # Keep the gradient per id: the optimizer coalesces it and updates in one pass. The
        # requests' gradients are copied into one (N, D) buffer of the table's own: the caller's
        # gradient tensors may be changed or reused after backward, and on a device they are
        # free as soon as backward moves on, not held until the step (micro-batches would pile up).
        # This is the only copy: the outputs are not a split of one tensor, whose backward would
        # concatenate the gradients first (measured, 26 tables x 4096 ids x 16: 1 ms a step less).
        dim = grads[0].shape[-1]
        if len(grads) == 1:
            src = grads[0].detach().reshape(-1, dim).to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        else:
            src = torch.cat([g.detach().reshape(-1, dim) for g in grads]).to(torch.float32)  # (a new tensor)
        scale = plan.scale if plan.scale is not None else torch.empty(0)
        ctx.group.pending.add(SparseGrad(plan.unique, None, RowSpace.GROUP, per_id=(src, plan.inverse, plan.offsets, scale),
                                         chain=(plan.first, plan.next)))
        return None, None, None, None, torch.empty(0), None, None
