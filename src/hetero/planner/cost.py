"""A candidate's predicted step time and bytes: :class:`MeasuredCost`, priced from a captured model
and this machine's calibration, behind the search's seam (:mod:`hetero.planner.cost_types`).

The search sees a model as a sequence of units, each with a few options (:class:`UnitChoice`),
under a model-wide :class:`Candidate`. A cost model gives, per unit and option, a
:class:`UnitCost`; per boundary ``i`` (into unit ``i``; ``0``: the batch into the first unit,
``n``: the last unit's output into the loss, both on the device), given the options on its two
sides, a :class:`BoundaryCost` - the copies' seconds when the sides are on different targets,
and the boundary tensors the device keeps, which depends on both sides (a tensor the unit before
keeps as its output and the unit after as its input is one tensor on one target, two on two);
and the costs no unit decides (:class:`FixedCost`). With the kept bytes in order ``b_0, u_0,
b_1, u_1, ..., b_n``, they combine as

* step seconds = fixed + the units' + the boundaries';
* device peak = fixed + the units' static bytes + ``max(sum of kept + fixed during,
  max_i(kept before u_i + during_i), max_i(kept before u_i + b_i's during))``: in backward, unit
  ``i`` holds what it and everything before it kept, plus what its own backward rebuilds (a
  recomputed unit's activations) and its gradient workspace; in forward, a device tensor handed
  to a host unit is alive beside everything kept before it;
* host bytes = fixed + the units'.

Reference: Checkmate (Jain et al. 2020) for the activation-memory model of recomputation;
ZeRO-Offload (Ren et al. 2021) for the offloaded optimizer's bytes per parameter.
"""

from __future__ import annotations

from collections.abc import Mapping

from hetero.optim import DEVICE_SPARSE_OPTIMIZERS, SparseOptimizerKind
from hetero.placement import Target
from hetero.planner.calibration import Calibration
from hetero.planner.calibration_types import DiskRate
from hetero.planner.cost_types import BoundaryCost, FixedCost, UnitCost
from hetero.planner.graph import ModelGraph, OpCost, OpFamily, TableInfo, Unit
from hetero.parallel.comm import Collective
from hetero.storage import SsdConfig
from hetero.planner.space import (
    CostPart,
    STREAMED,
    UNIT_CHOICES,
    Candidate,
    OptimizerKind,
    StateHome,
    UnitChoice,
    sparse_optimizer_of,
)
from hetero.planner.table_cost import TablePricing
from hetero.planner.tensor_parallel import TensorSharding


_STATE_BYTES = {OptimizerKind.ADAMW: 8, OptimizerKind.ADAM: 8, OptimizerKind.SGD: 0,
                OptimizerKind.SGD_MOMENTUM: 4}  # per fp32 element
HOST_ADAMW_BYTES = 16  # per parameter on the host: fp32 master, two moments, the gradient buffer


class MeasuredCost:
    """:class:`CostModel` of a captured model on this machine's calibration.

    Args:
        graph: the captured model (its unit ``""`` - ops of no unit - runs on the device).
        calibration: this machine's rates (its exact-shape timings already added for ``graph``).
        optimizer: the dense optimizer (:class:`OptimizerKind`).
        sparse: each host table's sparse optimizer, by the start of its qualified name (longest
            match; default LazyAdam).
        pinned: unit name -> the target a user annotation gives it.
        host_units: dense units may go to the host (the partitioner captures the model's graph;
            through its hook fallback, copies this model does not price would run).
        tensor: the operator strategies by tensor-parallel degree (a candidate's ``tp > 1``
            prices its units' shares and collectives); ``staged_tensor``: the same with every
            value whole between pipeline units (a candidate with ``pp > 1`` beside ``tp``).
        device_tables: tables may move to the device (on one data-parallel rank; float32 tables
            whose sparse optimizer torch has).
        streamable: the units whose weights may live on the host (the partitioner traces the
            modules owning their parameters: :func:`hetero.planner.capture.streamable_units`).
        shares: by ``dp`` degree, the model captured on a rank's share of the batch (its ops
            timed at those shapes; without one, the global batch's ops scaled to the share).
        ssd: host tables may go on the SSD tier with these settings (its cache budget per
            group), priced with ``disk`` (this disk's :class:`DiskRate`); ``None``: they stay in memory.
    """

    def __init__(self, graph: ModelGraph, calibration: Calibration, optimizer: OptimizerKind,
                 sparse: Mapping[str, SparseOptimizerKind] = {}, pinned: Mapping[str, Target] = {},
                 host_units: bool = True, tensor: Mapping[int, TensorSharding] = {},
                 device_tables: bool = True, staged_tensor: Mapping[int, TensorSharding] = {},
                 streamable: frozenset[str] = frozenset(), shares: Mapping[int, ModelGraph] = {},
                 ssd: SsdConfig | None = None, disk: DiskRate | None = None) -> None:
        self.graph, self.cal, self.optimizer, self.shares = graph, calibration, optimizer, shares
        self.units = [u for u in graph.units if u.name]
        self.root = next(u for u in graph.units if not u.name)
        self.sparse, self.pinned, self.host_units, self.tensor = sparse, pinned, host_units, tensor
        self.streamable = streamable
        self.staged_tensor = staged_tensor
        self.tables = TablePricing(graph, calibration, sparse, ssd, disk)
        self._movable: dict[int, list[TableInfo]] = {}
        # remembered: the searches ask for the same unit's passes under many candidates (the hot spot)
        self._pass_seconds: dict[tuple[str, bool, Target, int, int], float] = {}
        self._unit_costs: dict[tuple[int, UnitChoice, Candidate], UnitCost] = {}
        for i, u in enumerate(self.units):
            kinds = {t.name: sparse_optimizer_of(t.name, sparse) for t in u.tables}
            movable = [t for t in u.tables if device_tables and t.row_bytes == 4 * t.dim and not t.dynamic and
                       kinds[t.name] in DEVICE_SPARSE_OPTIMIZERS and kinds[t.name].value in calibration.device_tables]
            self._movable[i] = sorted(movable, key=lambda t: -self.tables.ids(t) / self.tables.device_bytes(t))

    def ssd_order(self, i: int) -> list[TableInfo]:
        """Unit ``i``'s tables in the order they go on the SSD tier (:class:`UnitChoice`'s
        ``ssd_tables = k``: the first ``k``): the fewest looked-up ids per byte of table first
        (the coldest host memory is given up first); empty without the planner's ``ssd``."""
        if self.tables.ssd is None:
            return []
        return sorted(self.units[i].tables, key=lambda t: self.tables.ids(t) / (t.rows * t.row_bytes))

    def table_order(self, i: int) -> list[TableInfo]:
        """Unit ``i``'s tables that may move to the device (float32 rows, a sparse optimizer torch
        has for sparse gradients), the most looked-up ids per byte of table and state first: a
        :class:`UnitChoice`'s ``device_tables = k`` moves the first ``k`` (a greedy knapsack
        order: a byte of the device budget saves the most host work on the tables first in it)."""
        return self._movable.get(i, [])

    def _shares(self, name: str, c: Candidate) -> tuple[float, float]:
        """A unit's share of compute and of parameter elements on one rank of ``c``'s ``tp``."""
        if c.tp == 1:
            return 1.0, 1.0
        t = self.sharding(c)
        return t.compute_share.get(name, 1.0), t.param_share.get(name, 1.0)

    def sharding(self, c: Candidate) -> TensorSharding:
        """``c``'s operator strategies (``tp > 1``): with a pipeline, those whole between its units."""
        return (self.staged_tensor if c.pp > 1 else self.tensor)[c.tp]

    def _tp_seconds(self, name: str, c: Candidate) -> float:
        """Seconds of the tp collectives of unit ``name``'s ops (``""``: the ops of no unit) per step."""
        if c.tp == 1:
            return 0.0
        return self.sharding(c).seconds(self.cal.collective_curves(c.tp), self._scale(c), c.micro_batches, name)

    def names(self) -> list[str]:
        return [u.name for u in self.units]

    def options(self, i: int, c: Candidate) -> tuple[UnitChoice, ...]:
        u = self.units[i]
        if u.tables:  # the lookups run where the rows are: the first k tables on the device, the rest on the host
            # (one rank's tables: device tables replicated over data-parallel ranks are not modelled)
            movable = self.table_order(i) if c.dp == 1 else []
            return (UnitChoice(Target.HOST),) + tuple(
                UnitChoice(Target.DEVICE if k == len(u.tables) else Target.HOST, device_tables=k)
                for k in range(1, len(movable) + 1)) + tuple(
                UnitChoice(Target.HOST, ssd_tables=k) for k in range(1, len(self.ssd_order(i)) + 1))
        out = [x for x in UNIT_CHOICES if not (x.recompute and not u.saved_bytes)
               and (self.host_units or x.target is Target.DEVICE or u.name in self.pinned)
               and (x.target is Target.DEVICE or c.takes_host_units()
                    or (u.name in self.pinned and c.takes_pinned_host_units()))]
        if u.name in self.streamable and u.name not in self.pinned and c.takes_host_units():
            out.append(STREAMED)  # (host parameters beside DDP or a stage's replicas as a host unit's)
        pin = self.pinned.get(u.name)
        return tuple(x for x in out if pin is None or x.target is pin)

    def _scale(self, c: Candidate) -> float:
        return 1.0 / (c.dp * c.micro_batches)  # a pass's share of the captured batch

    def _passes(self, name: str, backward: bool, target: Target, c: Candidate) -> float:
        """Seconds of unit ``name``'s forward (or backward) ops over a step's passes: a ``dp``
        rank's ops as captured on its share of the batch (``shares``), each op's work scaled to a
        micro-batch's share (measured: isolated replays of smaller shapes flatter a pass, which
        the scaling along the family's curve does not)."""
        # a host subgraph's forward runs on the partitioner's worker, its backward on autograd's
        # thread (the caller's, on CPU) with torch's count: beside a CPU device, the device's rates
        on = Target.DEVICE if backward and self.cal.host_is_device else target
        key = (name, backward, on, c.micro_batches, c.dp)
        if key not in self._pass_seconds:
            share = self.shares.get(c.dp)
            u, scale = (share.unit(name), 1.0 / c.micro_batches) if share is not None else \
                (self.graph.unit(name), self._scale(c))
            ops = u.backward if backward else u.forward
            self._pass_seconds[key] = c.micro_batches * sum(self.cal.op_seconds(on.value, op, scale) for op in ops)
        return self._pass_seconds[key]

    def unit(self, i: int, choice: UnitChoice, c: Candidate) -> UnitCost:
        key = (i, choice, c)
        if key not in self._unit_costs:
            self._unit_costs[key] = self._unit(i, choice, c)
        return self._unit_costs[key]

    def _unit(self, i: int, choice: UnitChoice, c: Candidate) -> UnitCost:
        u = self.units[i]
        if u.tables:
            seconds, device, host = self.tables.unit(u, c, self.table_order(i)[:choice.device_tables],
                                                     self.ssd_order(i)[:choice.ssd_tables])
            return UnitCost(seconds, device_static=device, host_bytes=host)
        s = self._scale(c)
        compute = self._passes(u.name, False, choice.target, c) * (2 if choice.recompute else 1) + \
            self._passes(u.name, True, choice.target, c)
        compute = compute * self._shares(u.name, c)[0] + self._tp_seconds(u.name, c)
        activations = int(u.saved_bytes * s)  # its own; its inputs are the boundary's
        if choice.target is Target.HOST:  # everything of it is the host's; torch's optimizer there
            update, state = self._host_update(u)
            compute += self._accumulate(u, c, Target.HOST, u.param_bytes) + self._host_replicas(u, c)
            return UnitCost(compute + update, host_bytes=2 * u.param_bytes + state + activations + int(u.input_bytes * s),
                            update_seconds=update)
        during = activations + int((u.input_bytes + u.output_bytes) * s)  # its activations + gradient workspace
        during += self.cal.scratch_bytes(int(u.output_bytes * s))  # its bias gradient's reduction scratch (CUDA)
        if choice.weights is Target.HOST:
            return self._streamed(u, c, compute, activations, during)
        kept = 0 if choice.recompute else activations
        static, host, seconds, streamed = self._dense_state(u, c)
        if streamed and not self.cal.host_is_device:
            # HostAdamW updates a parameter on the host worker as soon as backward has made (and
            # copied) its gradient, while the device goes on with the backward of the units before
            # it: hidden up to about one unit's backward (its own, as the measure of its
            # neighbour's), the last pass's (earlier passes accumulate on the device). Beside a
            # CPU device both compete for the same cores: no overlap counted there.
            seconds -= min(streamed, self._passes(u.name, True, Target.DEVICE, c) / c.micro_batches)
        # (FSDP2 at ZeRO 2, 3 sums each pass's reduce-scattered shard)
        compute += self._accumulate(u, c, Target.DEVICE, u.param_bytes * self._shares(u.name, c)[1] / (c.dp if c.zero >= 2 else 1))
        if c.state is not StateHome.DEVICE or c.micro_batches > 1:
            # one gradient in flight: streaming to the host, or beside the sum it accumulates into
            during += u.largest_param_bytes
        return UnitCost(compute + seconds, static, kept, during, host, seconds)

    def _accumulate(self, u: Unit, c: Candidate, target: Target, held: float) -> float:
        """Seconds of autograd adding each micro-batch's gradients after the first into the
        parameters' ``.grad`` (one in-place add per parameter: two reads and a write, ``held``
        bytes over ``u.param_tensors`` tensors): not in the captured graph, which is one pass."""
        if c.micro_batches == 1 or not u.param_tensors:
            return 0.0
        on = "device" if target is Target.DEVICE or self.cal.host_is_device else "host"  # (autograd's thread)
        add = self.cal.op_seconds(on, OpCost(OpFamily.MEMORY, 0, int(3 * held / u.param_tensors)))
        return (c.micro_batches - 1) * u.param_tensors * add

    def _streamed(self, u: Unit, c: Candidate, compute: float, activations: int, during: int) -> UnitCost:
        """A device unit whose parameters live on the host: each pass copies them in (autograd
        keeps the copy to the unit's backward) and their gradient out; torch's optimizer updates
        them there, beside their state."""
        nbytes = u.param_bytes
        if self.cal.host_is_device:  # the partitioner copies memory to memory both ways, as a device would
            copies = 2 * self.cal.op_seconds("device", OpCost(OpFamily.MEMORY, 0, 2 * nbytes))
        else:
            copies = self.cal.h2d.seconds(nbytes) + self.cal.d2h.seconds(nbytes)
        update, state = self._host_update(u)
        compute += self._host_replicas(u, c)
        # kept: its activations and the weights' copy; during its backward also a gradient on its way out
        return UnitCost(compute + c.micro_batches * copies + update, 0, activations + nbytes,
                        during + nbytes + u.largest_param_bytes, 2 * nbytes + state, update)

    def _host_replicas(self, u: Unit, c: Candidate) -> float:
        """Beside ``dp`` (outside a pipeline, whose stages price their own), a unit whose
        parameters live on the host has its gradients averaged by ``HostReplicaOptimizer``'s
        all-reduce, not by the collectives :meth:`fixed` prices over every unit's parameters
        (DDP's, ZeRO 1's gather, FSDP2's per-pass reduce-scatter and gathers): its share of the
        difference, at the aggregate's rates."""
        curves = self.cal.collective_curves(c.dp) if c.dp > 1 and c.pp == 1 else None
        total = self._dense_bytes(c)
        if not curves or not total:
            return 0.0
        return u.param_bytes / total * (curves[Collective.ALL_REDUCE].seconds(total) - self.gradient_seconds(c, total))

    def _dense_bytes(self, c: Candidate) -> float:
        """Bytes of one rank's dense parameters (what tp leaves it of each unit's)."""
        return sum(u.param_bytes * self._shares(u.name, c)[1] for u in self.graph.units)

    def _host_update(self, u: Unit) -> tuple[float, int]:
        """Seconds of torch's optimizer updating unit ``u``'s parameters on the host, and the
        bytes of its state there."""
        rate = self.cal.optimizer_rate(self.optimizer, Target.HOST)
        return rate.seconds(u.params, u.param_tensors) - rate.fixed, _STATE_BYTES[self.optimizer] * u.params

    def _dense_state(self, u: Unit, c: Candidate) -> tuple[int, int, float, float]:
        """Device bytes, host bytes and update seconds of a device unit's parameters, and of
        those seconds the offloaded part's (its host update and copies: HostAdamW streams them
        during backward)."""
        ratio = {StateHome.DEVICE: 0.0, StateHome.HOST: 1.0, StateHome.PARTIAL: c.offload_ratio}[c.state]
        share = self._shares(u.name, c)[1]  # what tp leaves one rank of the unit's parameters
        device_part = (1 - ratio) * u.params * share
        # offloaded gradients stream to the host as backward makes them - unless micro-batches
        # accumulate them on the device first (HostOffloadConfig.accumulate): then they stay
        held = 1.0 if c.micro_batches > 1 else 1 - ratio
        params = u.param_bytes * share
        state, grads = _STATE_BYTES[self.optimizer] * device_part, held * params
        zero = c.zero
        state = state / c.dp if zero >= 1 else state
        grads = grads / c.dp if zero >= 2 else grads
        params = params / c.dp if zero >= 3 else params
        rate, host_rate = self.cal.optimizer_rate(self.optimizer), self.cal.host_adamw
        update_elems = device_part / c.dp if zero >= 1 else device_part
        seconds = rate.seconds(update_elems, u.param_tensors) - rate.fixed if device_part else 0.0
        offloaded, streamed = ratio * u.params, 0.0
        if offloaded:
            host_s = host_rate.seconds(offloaded, u.param_tensors) - host_rate.fixed
            copies = 0.0 if self.cal.host_is_device else \
                self.cal.d2h.seconds(offloaded * 4) + self.cal.h2d.seconds(offloaded * 4)
            streamed = host_s + copies
            seconds += streamed
        return int(params + grads + state), int(HOST_ADAMW_BYTES * offloaded), seconds, streamed

    def _host_output_share(self, i: int, choice: UnitChoice) -> float:
        """The share of unit ``i``'s output its host tables make (its device tables' is on the
        device already): pooled tables make a row per bag, the others a row per id."""
        u = self.units[i]
        moved = {t.name for t in self.table_order(i)[:choice.device_tables]}
        size = {t.name: t.row_bytes * (self.graph.batch if t.pooled else max(self.tables.ids(t), 1.0)) for t in u.tables}
        return sum(v for k, v in size.items() if k not in moved) / max(sum(size.values()), 1.0)

    def boundary(self, i: int, before: UnitChoice | None, after: UnitChoice | None, c: Candidate) -> BoundaryCost:
        on = [x.target if x is not None else Target.DEVICE for x in (before, after)]
        seconds = 0.0
        if on[0] is not on[1] and not (i < len(self.units) and self.units[i].tables):
            seconds = self.cal.handoff_s * c.micro_batches if on[1] is Target.HOST else 0.0  # a host subgraph's start
            nbytes = (self.units[i - 1].output_bytes if i > 0 else self.graph.input_bytes) * self._scale(c)
            if i > 0 and self.units[i - 1].tables:
                nbytes *= self._host_output_share(i - 1, before)
            if self.cal.host_is_device:  # the partitioner copies memory to memory (forward), as a device would
                seconds += c.micro_batches * self.cal.op_seconds("device", OpCost(OpFamily.MEMORY, 0, int(2 * nbytes)))
            else:
                copy = self.cal.d2h if on[1] is Target.HOST else self.cal.h2d  # forward one way, backward back
                back = self.cal.h2d if on[1] is Target.HOST else self.cal.d2h
                seconds += c.micro_batches * (copy.seconds(nbytes) + back.seconds(nbytes))
        if after is None:
            return BoundaryCost(seconds)  # the loss's input: the fixed part's
        u = self.units[i]
        handed = int(u.input_bytes * self._scale(c)) if on[0] is Target.DEVICE and on[1] is Target.HOST else 0
        if i == 0:
            return BoundaryCost(seconds, 0, handed)  # the batch: the fixed part's
        mine = after.target is Target.DEVICE  # the unit after keeps its inputs (all of them, recomputing)
        theirs = before.target is Target.DEVICE and not before.recompute  # the unit before keeps its outputs
        if mine and after.recompute:
            kept = u.input_free_bytes
        elif mine and theirs:
            kept = u.input_either_bytes
        else:
            kept = u.input_own_bytes if mine else u.input_prev_bytes if theirs else 0
        return BoundaryCost(seconds, int(kept * self._scale(c)), handed)

    def fixed(self, c: Candidate) -> FixedCost:
        s = self._scale(c)
        root = self._passes("", False, Target.DEVICE, c) + self._passes("", True, Target.DEVICE, c)
        compute_share, param_share = self._shares("", c)
        rate = self.cal.optimizer_rate(self.optimizer)
        parts = {CostPart.COMPUTE_NO_UNIT: root * compute_share, CostPart.OPTIMIZER_FIXED: rate.fixed}
        device = int((self.graph.input_bytes + self.root.saved_bytes) * s) + \
            int((2 * self.root.param_bytes + _STATE_BYTES[self.optimizer] * self.root.params) * param_share)
        if c.state is not StateHome.DEVICE:
            parts[CostPart.OPTIMIZER_FIXED] += self.cal.host_adamw.fixed
        dense_bytes = self._dense_bytes(c)  # (each host unit's share moved to its own: _host_replicas)
        if c.tp > 1:  # (each unit's own are its cost's)
            parts[CostPart.TP_COLLECTIVES] = self._tp_seconds("", c)
        if c.dp > 1 and c.pp == 1:  # (a pipeline's stages reduce their own units': the stage split prices them)
            parts[CostPart.GRADIENT_COLLECTIVES] = self.gradient_seconds(c, dense_bytes)
        if c.dp > 1:  # the step's loss averaged over the replicas (hetero.apply's, a sync point): one latency
            curves = self.cal.collective_curves(c.dp)
            parts[CostPart.LOSS_AVERAGE] = curves[Collective.ALL_REDUCE].seconds(8) if curves else 0.0
        return FixedCost(parts, device, 0, int(2 * self.root.grad_bytes * s))

    def gradient_seconds(self, c: Candidate, nbytes: float) -> float:
        """Seconds of the gradient collectives of ``nbytes`` of parameters over ``c``'s ``dp``
        ranks per step (0 without ``dp`` or a calibration of that group size): once (DDP reduces
        the micro-batches' sum; a pipeline's schedule syncs once), or per micro-batch at ZeRO 2, 3
        outside a pipeline (FSDP2 reduce-scatters each pass's gradients, gathers for each pass)."""
        curves = (self.cal.collective_curves(c.dp) or {}) if c.dp > 1 else {}
        if not curves:
            return 0.0
        passes = c.micro_batches if c.zero >= 2 and c.pp == 1 else 1
        # (the curves' sizes: an all-reduce's and a reduce-scatter's input, an all-gather's part per rank)
        if c.zero == 0:  # DDP: one all-reduce of the gradients
            return curves[Collective.ALL_REDUCE].seconds(nbytes)
        gather = curves[Collective.ALL_GATHER].seconds(nbytes / c.dp)  # each rank's updated part of the parameters to all
        if c.zero == 1:  # DDP's all-reduce, then torch's ZeroRedundancyOptimizer sends each rank's updated part
            return curves[Collective.ALL_REDUCE].seconds(nbytes) + gather
        # FSDP2: gradients reduce-scattered; parameters gathered once (ZeRO 2), or before the
        # forward and again before the backward (ZeRO 3: resharded after the forward)
        return passes * (curves[Collective.REDUCE_SCATTER].seconds(nbytes) + (2 if c.zero == 3 else 1) * gather)
