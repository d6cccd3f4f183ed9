"""``hetero.explain(model, example_inputs)``: what the partitioner makes of a model."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Any

import torch
from torch import nn

from hetero.placement.annotate import PlacementSpec
from hetero.placement.assign import host_resident
from hetero.placement.partitioner import HeteroModule, Subgraph, _recorder, partition
from hetero.placement.target import Target


@dataclasses.dataclass
class Explanation:
    """The partition of one model.

    Attributes:
        subgraphs: in execution order, with target, ops and the subgraphs they consume.
        param_bytes: bytes of parameters placed on each target.
        h2d_bytes / d2h_bytes: bytes copied host->device / device->host by one forward pass on
            the example inputs (the backward pass copies the same amounts the other way).
        concurrent: pairs of host and device subgraphs with no dependency path between them,
            which run at the same time.
        fallback_reason: set when the graph could not be captured.
        operator_parallel: the operator-sharding section when ``hetero.explain`` was given a
            sharding plan (a ``hetero.parallel.sharding_graph.ShardingReport``).
        data_parallel: the collectives per step and their sizes when ``hetero.explain`` was given
            a data-parallel mesh (a ``hetero.parallel.dp_plan.CollectivePlan``).
        pipeline: the stages and the predicted bubble when ``hetero.explain`` was given a
            pipeline config (a ``hetero.parallel.pipeline_plan.PipelinePlan``); printed last.
        storage: the tables on the SSD tier, their caches and hit rates, when there are any (a
            ``hetero.storage.report.TierReport``).
    """

    subgraphs: list[Subgraph]
    param_bytes: dict[Target, int]
    h2d_bytes: int
    d2h_bytes: int
    concurrent: list[tuple[str, str]]
    fallback_reason: str | None = None
    operator_parallel: object | None = None
    data_parallel: object | None = None
    pipeline: object | None = None
    storage: object | None = None

    def __str__(self) -> str:
        sections = [self._placement_text(), self.storage, self.operator_parallel, self.data_parallel, self.pipeline]
        return "\n".join(str(s) for s in sections if s is not None)

    def _placement_text(self) -> str:
        if self.fallback_reason:
            return f"no graph captured ({self.fallback_reason}); module-level placement with hooks"
        lines = [f"{len(self.subgraphs)} subgraphs"]
        for s in self.subgraphs:
            ops = Counter(f"{kind}@{path or '(model)'}" for kind, path in s.ops)
            desc = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in ops.items())
            after = f" <- {', '.join(s.inputs)}" if s.inputs else ""
            lines.append(f"  {s.name} [{s.target.value}]{after}: {desc}")
        lines.append("parameters: " + ", ".join(f"{t.value} {_size(b)}" for t, b in self.param_bytes.items()))
        lines.append(f"per step: host->device {_size(self.h2d_bytes)}, device->host {_size(self.d2h_bytes)} "
                     "in the forward pass (the backward pass moves the same the other way)")
        pairs = ", ".join(f"{a} || {b}" for a, b in self.concurrent) or "none"
        lines.append(f"may run concurrently: {pairs}")
        return "\n".join(lines)


def explain(model: nn.Module, example_inputs: tuple[Any, ...], spec: PlacementSpec | None = None) -> Explanation:
    """Partition a copy of ``model`` (or use a :class:`HeteroModule` as it is), run one forward
    pass on ``example_inputs`` without gradients, and describe the result.

    Raises:
        ValueError: as :func:`partition`.
    """
    hm = model if isinstance(model, HeteroModule) else partition(_copy_sharing_host_state(model), spec)
    if hm.split is None:
        return Explanation([], {}, 0, 0, [], hm.fallback_reason)
    _recorder.active = {"host": 0, "device": 0}
    try:
        with torch.no_grad():
            hm(*example_inputs)
        moved = _recorder.active
    finally:
        _recorder.active = None
    param_bytes: dict[Target, int] = {}
    params = dict(hm.model.named_parameters())
    for name, target in hm.param_targets.items():
        p = params[name]
        param_bytes[target] = param_bytes.get(target, 0) + p.numel() * p.element_size()
    return Explanation(hm.subgraphs, param_bytes, moved["device"], moved["host"], _independent(hm.subgraphs))


def _copy_sharing_host_state(model: nn.Module) -> nn.Module:
    """A copy of ``model`` to partition without moving the caller's parameters. Host-resident
    modules (``HostEmbedding``) share their parameters and non-module state with the original:
    their tables can be hundreds of GB, and the group that holds their storage owns locks that
    cannot be copied. Their buffers are copied, so the partition of the copy moves only its own."""
    memo: dict[int, object] = {}
    for m in model.modules():
        if host_resident(m):
            for p in m.parameters(recurse=False):
                memo[id(p)] = p  # deepcopy's memo protocol: keyed by id, maps an object to its copy
            for key, value in vars(m).items():
                if key not in ("_parameters", "_buffers", "_modules"):
                    memo[id(value)] = value
    return copy.deepcopy(model, memo)


def _independent(subgraphs: list[Subgraph]) -> list[tuple[str, str]]:
    ancestors: dict[str, set[str]] = {}
    for s in subgraphs:  # execution order is topological
        ancestors[s.name] = set(s.inputs).union(*(ancestors[i] for i in s.inputs))
    out = []
    for i, a in enumerate(subgraphs):
        for b in subgraphs[i + 1 :]:
            if a.target is not b.target and a.name not in ancestors[b.name] and b.name not in ancestors[a.name]:
                out.append((a.name, b.name))
    return out


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
