"""What data parallelism sends per step: the collectives of the dense part (DDP's gradient
buckets, ZeRO's broadcasts, FSDP2's per-unit all-gathers and reduce-scatters) and of the host
tables' sparse exchange, with their sizes, planned from the model and the configs alone (no
process group). ``hetero.explain(..., mesh={MeshDim.DP: n}, fusion=..., zero=...)`` prints it.

The model of each mechanism (checked against counted collectives in the tests):

- stages 0 and 1: one all-reduce per DDP bucket (:func:`~hetero.parallel.comm_fusion.gradient_buckets`,
  steady state: DDP rebuilds its size buckets in the order backward produced the gradients in
  the first step - measured here by one backward pass on the example inputs); stage 1
  adds ``ZeroRedundancyOptimizer``'s one broadcast per parameter from the rank that updated it.
- stages 2 and 3 (FSDP2): per unit (:func:`~hetero.parallel.zero.fusion_units` or the named ones,
  then the root with the rest), one all-gather in forward and one reduce-scatter in backward;
  stage 3 gathers every unit but the root again in backward (FSDP2 keeps the root's parameters
  after forward). A parameter's shard is ``ceil(dim0 / n)`` rows (``Shard(0)``, padded).
- host tables (replicated): one all-gather of every group's row count, then the step's gradient
  rows (their size depends on the batch's ids: listed without bytes). Row-sharded tables: three
  all-to-alls per lookup (counts, ids, rows), then one all-reduce and one all-to-all per step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from hetero.embedding import RowPlacement, host_tables
from hetero.parallel.comm import Collective, collective_bytes, summarize
from hetero.parallel.comm_fusion import CommFusion, gradient_buckets
from hetero.parallel.zero import ZeroConfig, ZeroStage, zero_units


@dataclasses.dataclass(frozen=True)
class PlannedCollective:
    """One collective of a step.

    Attributes:
        kind: which collective.
        what: what it carries (e.g. ``"gradients of 4 parameters"``, ``"unit blocks.0"``).
        input_bytes: bytes of the local input handed to it; ``None`` where the batch decides.
        bytes: bytes one rank receives (:func:`~hetero.parallel.comm.collective_bytes`); ``None`` likewise.
    """

    kind: Collective
    what: str
    input_bytes: int | None
    bytes: float | None


@dataclasses.dataclass
class CollectivePlan:
    """The collectives of one training step over ``dp`` data-parallel ranks, in issue order per mechanism."""

    dp: int
    calls: list[PlannedCollective]

    def summary(self) -> dict[str, dict[str, float]]:
        """Per collective kind: ``{"calls": ..., "bytes": ...}`` (bytes of the sized ones)."""
        return summarize(self.calls)

    def __str__(self) -> str:
        lines = [f"data parallel over {self.dp} ranks: {len(self.calls)} collectives per step"]
        for kind, row in self.summary().items():
            lines.append(f"  {kind}: {row['calls']} calls, {row['bytes'] / 2**20:.2f} MB received per rank")
        for c in self.calls:
            size = "size set by the batch" if c.input_bytes is None else f"{c.input_bytes} B in"
            lines.append(f"    {c.kind.value} {c.what}: {size}")
        return "\n".join(lines)


def plan_collectives(model: nn.Module, example_inputs: tuple[Any, ...], dp: int, fusion: CommFusion = CommFusion(),
                     zero: ZeroConfig = ZeroConfig()) -> CollectivePlan:
    """The collectives one step of ``model`` issues over ``dp`` data-parallel ranks (see the
    module docstring). Nothing is sent. The model runs forward and backward once on
    ``example_inputs`` (``torch.autograd.grad``: no ``.grad`` or host-table gradient is left,
    the random state is restored, batch-norm statistics are not updated: eval mode).

    Raises:
        ValueError: an all-reduce index list past the model's parameters, a ZeRO unit the model
            does not have.
    """
    calls: list[PlannedCollective] = []

    def add(kind: Collective, what: str, nbytes: int | None) -> None:
        calls.append(PlannedCollective(kind, what, nbytes, None if nbytes is None else collective_bytes(kind, nbytes, dp)))

    tables = host_tables(model)
    host = {t.weight for t in tables.values()}  # keyed by the tensor itself
    if dp > 1:
        if zero.stage >= ZeroStage.GRADIENTS:
            _plan_fsdp(model, dp, fusion, zero, host, add)
        else:
            dense = [p for p in model.parameters() if p.requires_grad and p not in host]
            sizes = [p.numel() * p.element_size() for p in dense]
            ready = _ready_order(model, example_inputs, dense) if dense else []
            for bucket in gradient_buckets(sizes, fusion.allreduce, ready):
                add(Collective.ALL_REDUCE, f"gradients of {len(bucket)} parameters", sum(sizes[i] for i in bucket))
            if zero.stage is ZeroStage.OPTIMIZER_STATES:
                for i, size in enumerate(sizes):
                    add(Collective.BROADCAST, f"parameter {i} from the rank that updated it", size)
        _plan_tables(tables, add)
    return CollectivePlan(dp, calls)


def _ready_order(model: nn.Module, example_inputs: tuple[Any, ...], params: list[torch.Tensor]) -> list[int]:
    """Indices of ``params`` in the order one backward pass on ``example_inputs`` produces their gradients."""
    order: list[int] = []
    handles = [p.register_hook(lambda g, i=i: order.append(i)) for i, p in enumerate(params)]
    training = model.training
    try:
        model.eval()
        with torch.random.fork_rng(devices=[]):
            out = model(*example_inputs)
            leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            loss = sum(t.float().sum() for t in leaves)
            # only the listed parameters' gradients: host tables' lookups are not on these paths
            torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        model.train(training)
        for h in handles:
            h.remove()
    missing = [i for i in range(len(params)) if i not in set(order)]
    return list(dict.fromkeys(order)) + missing[::-1]  # unused parameters: DDP marks them ready last


def _shard_bytes(module_params: list, dp: int) -> int:
    return sum(math.ceil(p.shape[0] / dp) * (p.numel() // max(p.shape[0], 1)) * p.element_size() if p.dim() else
               p.element_size() for p in module_params)


def _plan_fsdp(model: nn.Module, dp: int, fusion: CommFusion, zero: ZeroConfig, host: set, add) -> None:  # noqa: ANN001
    taken: set = set()
    groups = []
    for unit in zero_units(model, zero, fusion):
        params = [p for n in unit for p in model.get_submodule(n).parameters() if p not in host and p not in taken]
        taken.update(params)
        groups.append((",".join(unit), params))
    rest = [p for p in model.parameters() if p not in host and p not in taken]
    if rest:
        groups.insert(0, ("(root)", rest))  # the root gathers its own parameters before its children run
    for label, params in groups:  # forward: units in execution order (registration order here)
        add(Collective.ALL_GATHER, f"unit {label}", _shard_bytes(params, dp))
    for label, params in reversed(groups):
        if zero.stage is ZeroStage.PARAMETERS and label != "(root)":  # resharded after forward
            add(Collective.ALL_GATHER, f"unit {label} (backward)", _shard_bytes(params, dp))
        add(Collective.REDUCE_SCATTER, f"gradients of unit {label}", _shard_bytes(params, dp) * dp)


def _plan_tables(tables: dict, add) -> None:  # noqa: ANN001
    groups = list(dict.fromkeys(t.group for t in tables.values()))
    local = [g for g in groups if g.exchange.placement is RowPlacement.LOCAL]
    sharded = [g for g in groups if g.exchange.placement is RowPlacement.ROW_SHARDED]
    for g in sharded:
        for what in ("row counts", "ids", "rows"):
            add(Collective.ALL_TO_ALL, f"lookup {what} of a row-sharded table group (per lookup)", None)
    if sharded:
        add(Collective.ALL_REDUCE, "which row-sharded groups were looked up", 8 * len(sharded))
        add(Collective.ALL_TO_ALL, "gradient rows of every row-sharded group to their owners", None)
    if local:
        add(Collective.ALL_GATHER, "row counts of the replicated table groups", 8 * len(local))
        add(Collective.ALL_GATHER, "gradient rows of the replicated table groups (one per allgather bucket)", None)
