"""What a plan decides: the typed vocabulary of the search space.

Per unit (:class:`UnitChoice`): host or device, and whether it recomputes its activations in
backward. Per model (:class:`Candidate`, the outer enumeration): the mesh ``(pp, dp, tp)``, where
the dense optimizer's state lives and updates (:class:`StateHome`, with the offload ratio of a
partial offload), gradient-accumulation micro-batches, the ZeRO stage, and where the host tables
live across ranks (:class:`TablePlacement`). Reference: the reference design's strategy search
(``auto_parallel_search_mode``) and ZeRO-Offload's placement of optimizer state.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Protocol

from hetero.optim import SparseOptimizerKind
from hetero.placement import Target


class OptimizerKind(enum.Enum):
    """The model's dense optimizer - the math, which a plan never changes (only where it runs)."""

    ADAMW = "adamw"  # torch.optim.AdamW; offloaded: HostAdamW (the same update). Two moments per element
    ADAM = "adam"  # torch.optim.Adam; offloaded (weight_decay 0): HostAdamW (the same update). Two moments
    SGD = "sgd"  # torch.optim.SGD without momentum: no state
    SGD_MOMENTUM = "sgd_momentum"  # torch.optim.SGD with momentum: one buffer per element, beside its parameters

    @property
    def calibrated(self) -> str:
        """The calibration's rate it runs at (Adam's is AdamW's: the same moments, the same work)."""
        return OptimizerKind.ADAMW.value if self is OptimizerKind.ADAM else self.value


ADAM_FAMILY = (OptimizerKind.ADAMW, OptimizerKind.ADAM)  # what HostAdamW runs off the device


class CostPart(enum.Enum):
    """What a step's predicted seconds are made of (a plan's ``predicted.parts``; they add up)."""

    COMPUTE_NO_UNIT = "compute (ops of no unit)"
    OPTIMIZER_FIXED = "optimizer fixed"
    TP_COLLECTIVES = "tensor-parallel collectives (ops of no unit)"
    GRADIENT_COLLECTIVES = "gradient collectives"
    LOSS_AVERAGE = "loss average"
    HOST_TABLES = "host tables"
    UNITS_WITH_HOST_WEIGHTS = "units with host weights"
    DEVICE_UNITS = "units on the device"
    HOST_UNITS = "units on the host"
    CROSSINGS = "host<->device copies and hand-offs"
    SLOWEST_STAGE = "the slowest stage (its work with the pipeline fill and drain, its replicas' all-reduce)"


class MemoryPart(enum.Enum):
    """What a plan's device peak is made of (what a no-plan error names as dominating)."""

    UNIT_STATE = "parameters, gradients and optimizer state of the device units"
    BATCH_AND_ROOT = "the batch and the ops of no unit"
    ACTIVATIONS = "activations held in backward"


class StateHome(enum.Enum):
    """Where the dense optimizer's state (and the fp32 master weights) of device-placed
    parameters lives and updates."""

    DEVICE = "device"  # torch's optimizer beside the parameters
    HOST = "host"  # HostAdamW: masters and moments on the host, gradients streamed (ZeRO-Offload)
    PARTIAL = "partial"  # PartialOffloadAdamW: ``offload_ratio`` of the elements on the host


class TablePlacement(enum.Enum):
    """Where host tables live across the data-parallel ranks."""

    HOST = "host"  # one process: its host holds every table
    REPLICATED = "replicated"  # every rank's host holds whole tables; sparse gradients all-gathered
    ROW_SHARDED = "row_sharded"  # each rank holds 1/dp of every table's rows; ids and rows all-to-all
    PARAMETER_SERVER = "parameter_server"  # servers hold the rows (hetero.ps); workers pull and push them


def sparse_optimizer_of(table: str, by_prefix: Mapping[str, SparseOptimizerKind]) -> SparseOptimizerKind:
    """A host table's sparse optimizer: that of the longest qualified-name prefix of ``table``
    in ``by_prefix`` (default LazyAdam)."""
    matches = [prefix for prefix in by_prefix if table.startswith(prefix)]
    return by_prefix[max(matches, key=len)] if matches else SparseOptimizerKind.LAZY_ADAM


@dataclasses.dataclass(frozen=True, order=True)
class UnitChoice:
    """One unit's decision.

    Attributes:
        target: where its ops run and its parameters live (a unit of tables: ``DEVICE`` when
            every one of its tables is on the device).
        recompute: its activations are dropped after forward and recomputed in backward
            (``torch.utils.checkpoint``; device units only).
        device_tables: a unit of tables: how many of them move to the device, the first in the
            cost model's order (:meth:`hetero.planner.cost.MeasuredCost.table_order`); the rest
            stay host tables.
        weights: where a device unit's parameters live: ``HOST`` keeps them (and their
            gradients and optimizer state, updated by torch's optimizer there) in host memory and
            copies them to the device for each pass - autograd keeps the copy until the unit's
            backward - and their gradients back: the parameter offload of ZeRO-Offload/Infinity
            (Ren et al. 2021; Rajbhandari et al. 2021; DeepSpeed's ``offload_param``), decided
            per unit. No recompute with it.
        ssd_tables: a unit of host tables: how many of them go on the SSD tier (the planner's
            ``ssd`` setting), the first in the cost model's SSD order
            (:meth:`hetero.planner.cost.MeasuredCost.ssd_order`: the fewest looked-up ids per
            byte first); the rest stay in host memory.
    """

    target: Target = Target.DEVICE
    recompute: bool = False
    device_tables: int = 0
    weights: Target = Target.DEVICE
    ssd_tables: int = 0

    def __str__(self) -> str:
        if self.ssd_tables:
            return f"host, {self.ssd_tables} table(s) on the SSD tier"
        if self.device_tables and self.target is Target.HOST:
            return f"host, {self.device_tables} table(s) on the device"
        if self.weights is Target.HOST:
            return "device, weights streamed from the host"
        return self.target.value + (" + recompute" if self.recompute else "")


UNIT_CHOICES = (UnitChoice(Target.DEVICE), UnitChoice(Target.DEVICE, True), UnitChoice(Target.HOST))
STREAMED = UnitChoice(Target.DEVICE, weights=Target.HOST)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A model-wide setting the per-unit search runs under.

    Attributes:
        pp, dp, tp: the mesh (``pp * dp * tp`` = world size).
        state: where the dense optimizer's state lives (:class:`StateHome`).
        offload_ratio: with ``StateHome.PARTIAL``, the fraction of elements on the host.
        micro_batches: gradient-accumulation passes per step (pipeline micro-batches when
            ``pp > 1``): a pass holds ``1 / micro_batches`` of the activations.
        zero: ZeRO stage over ``dp`` (1: optimizer state, 2: + gradients, 3: + parameters).
        tables: where host tables live (:class:`TablePlacement`).
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    state: StateHome = StateHome.DEVICE
    offload_ratio: float = 0.0
    micro_batches: int = 1
    zero: int = 0
    tables: TablePlacement = TablePlacement.HOST

    def takes_host_units(self) -> bool:
        """Whether dense units may run on the host (or keep their weights there) under this
        setting: not beside ``tp`` (the partitioner's host subgraphs take no DTensors). Beside
        ``dp`` every replica (of the model, or of a pipeline's stage) holds them; their gradients
        are averaged apart from DDP's, replicate's or FSDP2's, which leave them out
        (:class:`hetero.parallel.data_parallel.HostReplicaOptimizer`)."""
        return self.tp == 1

    def takes_pinned_host_units(self) -> bool:
        """Whether the units a user pins to the host may run there under this setting: wherever
        any unit may, and beside ``tp`` outside a pipeline (the operator strategies propagated
        with them whole, their values whole and plain at their borders; every tp rank runs
        them whole; a pipeline's stages are propagated apart)."""
        return self.takes_host_units() or self.pp == 1

    def describe(self) -> dict[str, str]:
        """The candidate's decisions in words, by name (as ``hetero.explain`` prints them)."""
        state = self.state.value + (f" ({self.offload_ratio:.2f} on the host)" if self.state is StateHome.PARTIAL else "")
        return {"mesh": f"pp {self.pp} x dp {self.dp} x tp {self.tp}", "optimizer state": state,
                "micro-batches": str(self.micro_batches), "ZeRO stage": str(self.zero), "host tables": self.tables.value}


def candidates(world_size: int, optimizer: OptimizerKind, batch: int, has_tables: bool,
               micro_batches: tuple[int, ...] = (1, 2, 4, 8), ratios: tuple[float, ...] = (0.25, 0.5, 0.75),
               max_pp: int = 1, max_tp: int = 1) -> list[Candidate]:
    """The outer enumeration: every mesh shape of ``world_size`` ranks (``pp <= max_pp``,
    ``tp <= max_tp``), state home (offload for AdamW only, without ``tp``), micro-batch count
    dividing the per-rank batch (at least ``pp``), ZeRO stage (with ``dp > 1``; 1 not beside ``tp``), and table placement
    (with ``dp > 1``). A pipeline's stages are operator-sharded over ``tp`` and replicated (or ZeRO 2, 3 sharded) over ``dp``."""
    out = []
    for pp in range(1, max_pp + 1):
        for tp in range(1, max_tp + 1):
            if world_size % (pp * tp):
                continue
            dp = world_size // (pp * tp)
            if batch % dp:
                continue
            per_rank = batch // dp
            homes = [(StateHome.DEVICE, 0.0)]
            if optimizer in ADAM_FAMILY and tp == 1:  # HostAdamW keeps whole master weights
                # (replicas: HostAdamW averages its part's gradients itself, DDP or replicate the rest)
                homes += [(StateHome.HOST, 1.0)] + [(StateHome.PARTIAL, r) for r in ratios]
            tables = [TablePlacement.HOST] if dp == 1 or not has_tables else \
                [TablePlacement.REPLICATED, TablePlacement.ROW_SHARDED]
            # (ZeRO 1 is torch's ZeroRedundancyOptimizer, which takes neither tp shards nor a schedule's stages)
            zeros = [0] if dp == 1 else [0, 2, 3] if tp > 1 or pp > 1 else [0, 1, 2, 3]
            for m in micro_batches:
                if per_rank % m or (pp > 1 and m < pp):
                    continue
                for state, ratio in homes:
                    for zero in zeros:
                        if zero and state is not StateHome.DEVICE:
                            continue  # an offloaded state shards itself (ShardedHostAdamW) - not modelled yet
                        for placement in tables:
                            out.append(Candidate(pp, dp, tp, state, ratio, m, zero, placement))
    return out


@dataclasses.dataclass(frozen=True)
class SpaceFacts:
    """What the enumeration of a model's settings depends on (the planner fills it in).

    Attributes:
        world_size: the ranks; ``optimizer``: the dense optimizer; ``batch``: the global batch.
        has_tables: the model holds host tables (their placement is a decision).
        micro_batches, offload_ratios: the counts and ratios to try.
        max_pp, max_tp: the largest pipeline and tensor-parallel degrees the model allows.
    """

    world_size: int
    optimizer: OptimizerKind
    batch: int
    has_tables: bool
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    offload_ratios: tuple[float, ...] = (0.25, 0.5, 0.75)
    max_pp: int = 1
    max_tp: int = 1


class Enumerator(Protocol):
    """The planner's first stage: the model-wide settings (:class:`Candidate`) to search, from
    the facts (TorchRec's ``Enumerator``). :func:`grid` is the default; the planner then keeps
    those its constraints allow (annotations, pinned host units, operator strategies)."""

    def __call__(self, facts: SpaceFacts) -> list[Candidate]: ...


def grid(facts: SpaceFacts) -> list[Candidate]:
    """Every setting :func:`candidates` enumerates (the default :class:`Enumerator`)."""
    return candidates(facts.world_size, facts.optimizer, facts.batch, facts.has_tables, facts.micro_batches,
                      facts.offload_ratios, facts.max_pp, facts.max_tp)
