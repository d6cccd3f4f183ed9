"""How the planner searches (:class:`PlannerConfig`, :class:`SearchMethod`) and what it raises
when no plan fits (:class:`NoPlanError`)."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path

from hetero.planner.graph import Granularity
from hetero.storage import SsdConfig


class SearchMethod(enum.Enum):
    """The per-unit search (:mod:`hetero.planner.search`)."""

    AUTO = "auto"  # the ILP up to ILP_UNITS units, the dynamic program beyond
    DYNAMIC_PROGRAMMING = "dynamic_programming"
    ILP = "ilp"
    BRUTE_FORCE = "brute_force"


ILP_UNITS = 40


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    """How the planner searches.

    Attributes:
        method: the per-unit search (:class:`SearchMethod`).
        micro_batches: gradient-accumulation counts to try (those dividing the per-rank batch).
        offload_ratios: partial-offload ratios to try (AdamW only).
        cache_dir: where the calibration is cached (default: hetero's cache directory).
        tolerance: predictions this close (a fraction) count as a tie, won by the plan that
            changes less (one pass, state on the device, fewer host/device switches and
            recomputed units): the cost model's error is of this order, and every change has
            overheads it does not price. In the per-unit search a recomputed unit costs this much
            more and a switch this much of a mean unit; predictions are reported without it.
        memory_margin: the device budget planned to is this much smaller (a fraction): the
            model's byte counts are within a few percent of a measured peak, and the budget is
            hard.
        device_tables: host tables may move to the device (``hetero.apply`` moves them; off
            for a training loop that keeps its tables on the host, as the main job's).
        granularity: what one unit is: the model's blocks, or every leaf module (per-op
            placement: finer plans, a longer search).
        ssd: host tables may go on the SSD tier with these settings (``hetero.apply`` puts them
            there), when host memory is the binding budget: the tier is slower, so a plan within
            the budgets without it is faster; its disk is measured once (:func:`disk`). ``None``
            (default): tables stay in memory.
    """

    method: SearchMethod = SearchMethod.AUTO
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    offload_ratios: tuple[float, ...] = (0.25, 0.5, 0.75)
    cache_dir: Path | None = None
    tolerance: float = 0.03
    memory_margin: float = 0.05
    device_tables: bool = True
    granularity: Granularity = Granularity.BLOCKS
    ssd: SsdConfig | None = None


class NoPlanError(ValueError):
    """No plan fits the budgets; the message gives the smallest budget that works and what
    dominates it."""
