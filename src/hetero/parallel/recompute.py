"""Recompute (activation checkpointing): drop a module's activations in forward and compute
them again in backward, trading compute for activation memory - whole modules, or selectively
keeping the outputs of chosen operator types (matmuls, attention) and recomputing the rest.

``recompute(module, save=...)`` wraps one module's forward in ``torch.utils.checkpoint``
(non-reentrant: composes with autograd hooks, DTensor operator-parallel layers, host-placed
subgraphs and FSDP2); :class:`RecomputeConfig` names the modules from outside the model by
qualified name, as ``PlacementSpec`` and ``ShardingPlan`` do. Module names stay as they were (the
wrapped forward is set on the module, no wrapper module is inserted), so state dicts, strategy
files and checkpoints are unchanged. Reference: Chen et al. 2016 (sublinear memory), the
reference design's ``recompute``; torch's selective activation checkpointing
(``create_selective_checkpoint_contexts``), as torchtitan applies it per block.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten


class RecomputeOp(enum.Enum):
    """Operator types whose outputs a selective policy keeps (the rest are recomputed)."""

    MATMUL = "matmul"
    ATTENTION = "attention"

    @property
    def aten_ops(self) -> frozenset:
        """The ATen operators of this type (what the selective policy sees at dispatch)."""
        if self is RecomputeOp.MATMUL:
            return frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
        names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
        return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


@dataclasses.dataclass(frozen=True)
class RecomputeConfig:
    """Which modules recompute their activations, and what a selective policy keeps.

    Attributes:
        modules: qualified names of the modules whose forward is recomputed in backward (each
            one checkpoint region: its inputs are kept, everything inside is recomputed).
        save: operator types whose outputs are kept inside those regions (selective
            recompute); empty: recompute everything (full recompute).
    """

    modules: tuple[str, ...] = ()
    save: frozenset[RecomputeOp] = frozenset()

    @staticmethod
    def parse_ops(names: Iterable[str]) -> frozenset[RecomputeOp]:
        """Operator types from their names (``"matmul"``, ``"attention"``).

        Raises:
            ValueError: a name that is not an operator type, listing the valid ones.
        """
        valid = {op.value: op for op in RecomputeOp}
        out = set()
        for name in names:
            if name not in valid:
                raise ValueError(f"recompute policy: no operator type {name!r}; valid: {sorted(valid)}")
            out.add(valid[name])
        return frozenset(out)


def _policy(save: frozenset[RecomputeOp]) -> Callable[..., CheckpointPolicy]:
    keep = frozenset().union(*(op.aten_ops for op in save))

    def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def recompute(module: nn.Module, save: frozenset[RecomputeOp] = frozenset()) -> nn.Module:
    """Make ``module`` recompute its forward in backward (in place; returns it).

    Its forward runs under non-reentrant ``torch.utils.checkpoint``; with ``save``, the outputs
    of those operator types are kept (selective). Gradients are those of the plain module
    (random ops replay the same draws: torch restores the RNG state for the recomputation).

    Raises:
        ValueError: ``module`` recomputes already.
    """
    if "forward" in vars(module):
        raise ValueError(f"{type(module).__name__} already has a recompute (or another) forward of its own")
    forward = module.forward
    context_fn = (lambda: create_selective_checkpoint_contexts(_policy(save))) if save else None

    @functools.wraps(forward)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # inference: nothing is saved, nothing to recompute
            return forward(*args, **kwargs)
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = recomputed
    return module


def apply_recompute(model: nn.Module, config: RecomputeConfig) -> None:
    """Apply ``config`` to ``model`` in place.

    Raises:
        ValueError: a name ``model`` does not have (listing its modules), or one module named
            inside another (their regions would nest).
    """
    modules = dict(model.named_modules())
    for name in config.modules:
        if name not in modules:
            raise ValueError(f"recompute policy names module {name!r}, which {type(model).__name__} does not have; "
                             f"its modules are {sorted(m for m in modules if m)[:40]}")
    for a in config.modules:
        for b in config.modules:
            if a != b and (a == "" or b.startswith(a + ".")):
                raise ValueError(f"recompute policy names {b!r} inside {a!r}; name one of them")
    for name in config.modules:
        recompute(modules[name], config.save)
