"""The :class:`CostModel` seam the search runs on and what it returns per unit
(:class:`UnitCost`), per boundary (:class:`BoundaryCost`) and for the rest of a step
(:class:`FixedCost`); how they combine is in :mod:`hetero.planner.cost`, which prices them from a
captured model (:class:`~hetero.planner.cost.MeasuredCost`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

from hetero.planner.space import Candidate, CostPart, UnitChoice


@dataclasses.dataclass(frozen=True)
class UnitCost:
    """One unit under one option.

    Attributes:
        seconds: its forward, backward, recompute and optimizer update per step.
        update_seconds: of ``seconds``, its parameters' optimizer update (once per step, after
            the last micro-batch's backward: a pipeline's fill and drain do not stretch it).
        device_static: its parameters, gradients and optimizer state on the device (bytes).
        device_kept: activations its forward keeps on the device until its backward.
        device_during: device bytes its backward holds (``device_kept`` and more).
        host_bytes: what it holds on the host.
    """

    seconds: float
    device_static: int = 0
    device_kept: int = 0
    device_during: int = 0
    host_bytes: int = 0
    update_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class BoundaryCost:
    """A boundary between two units: the copies' seconds, the tensors the device keeps there,
    and the device bytes alive only while the unit after runs its forward (a device tensor
    handed to a host unit lives until the host unit returns)."""

    seconds: float = 0.0
    device_bytes: int = 0
    device_during: int = 0


@dataclasses.dataclass(frozen=True)
class FixedCost:
    """What no unit's option changes: seconds by part, device and host bytes, and the device
    bytes the ops of no unit hold in their backward on top of everything kept (the loss's
    backward comes first, when every activation is alive)."""

    parts: Mapping[CostPart, float]
    device_bytes: int = 0
    host_bytes: int = 0
    device_during: int = 0

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())


class CostModel(Protocol):
    """What the search needs of a model (see the module docstring)."""

    def names(self) -> list[str]:
        """The units' names, in order."""

    def options(self, i: int, candidate: Candidate) -> tuple[UnitChoice, ...]:
        """Unit ``i``'s allowed options under ``candidate`` (an annotation pins one target)."""

    def unit(self, i: int, choice: UnitChoice, candidate: Candidate) -> UnitCost:
        """Unit ``i``'s cost under ``choice``."""

    def boundary(self, i: int, before: UnitChoice | None, after: UnitChoice | None,
                 candidate: Candidate) -> BoundaryCost:
        """Boundary ``i`` with unit ``i - 1`` under ``before`` and unit ``i`` under ``after``
        (``None``: the batch, or the loss - the device's)."""

    def fixed(self, candidate: Candidate) -> FixedCost:
        """The costs of ``candidate`` that no unit's option changes."""
