"""The per-unit search under one :class:`~hetero.planner.space.Candidate`: each unit's option
minimising the predicted step time with the device and host peaks within their budgets.

* :func:`evaluate` combines a cost model's parts into a step's seconds and peaks (the one rule,
  see :mod:`hetero.planner.cost`); every search is checked against it.
* :func:`dynamic_programming` walks the unit sequence keeping, per option of the last unit (a
  boundary's cost depends on both its sides), the Pareto frontier of partial assignments over
  (seconds, device static bytes, kept bytes, the running backward peak, host bytes): exact (a
  label is dropped only when another is no worse in every part), and a frontier past
  ``max_labels`` is thinned by rounding bytes to ``1 / resolution`` of the budget and coarser
  (then near-exact: a label is dropped for one faster and no more than a rounding step larger).
* :func:`ilp`: the same problem as a mixed-integer program solved by HiGHS
  (``scipy.optimize.milp``): one binary per unit and option, one per pair of options across a
  boundary (forced to 1 when both sides are chosen), and the backward peak as a variable above
  each unit's prefix sum - exact.
* :func:`brute_force`: every assignment (small graphs; the reference in tests).
* :class:`Biased`: the searches' tie-break - a cost model whose changes from the plain plan cost
  a tolerance more, so that of two plans predicted alike the one that changes less wins.
* :class:`SecondsOnly`: a cost model's seconds alone - searched with no budget, a candidate's
  lower bound (the planner's branch and bound over candidates).

Reference: Checkmate (Jain et al. 2020) for recomputation as an integer program; Alpa (Zheng et
al. 2022) and the reference design's ``dynamic_programming`` mode for DP over layer sequences.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

from hetero.placement import Target
from hetero.planner.cost import MeasuredCost
from hetero.planner.cost_types import BoundaryCost, CostModel, FixedCost, UnitCost
from hetero.planner.space import Candidate, UnitChoice


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Each unit's option, and what they add up to.

    Attributes:
        choices: per unit, in order.
        seconds: the predicted step time.
        device_bytes, host_bytes: the predicted peaks (of the largest stage, pipelined).
        cuts: with ``pp > 1``, the unit indices where stages ``1..pp-1`` begin
            (:mod:`hetero.planner.pipeline`).
    """

    choices: tuple[UnitChoice, ...]
    seconds: float
    device_bytes: int
    host_bytes: int
    cuts: tuple[int, ...] = ()


class Search(Protocol):
    """The planner's per-candidate stage: each unit's option under one setting within the
    budgets (bytes), or ``None`` where nothing fits (TorchRec's ``Proposer`` and
    ``Partitioner`` in one). :func:`ilp`, :func:`dynamic_programming` and :func:`brute_force`
    are the built-in ones; the planner prices what a search returns with the unbiased cost."""

    def __call__(self, cost: CostModel, candidate: Candidate, device_budget: float,
                 host_budget: float) -> "Assignment | None": ...


def evaluate(cost: CostModel, candidate: Candidate, choices: Sequence[UnitChoice]) -> Assignment:
    """The step seconds and peaks of ``choices`` under ``candidate`` (see :mod:`hetero.planner.cost`)."""
    fixed = cost.fixed(candidate)
    seconds, static, kept, peak, host = fixed.seconds, 0, 0, 0, fixed.host_bytes
    previous: UnitChoice | None = None
    for i, choice in enumerate(choices):
        b = cost.boundary(i, previous, choice, candidate)
        u = cost.unit(i, choice, candidate)
        seconds += b.seconds + u.seconds
        peak = max(peak, kept + b.device_during)
        kept += b.device_bytes
        static += u.device_static
        peak = max(peak, kept + u.device_during)
        kept += u.device_kept
        host += u.host_bytes
        previous = choice
    b = cost.boundary(len(choices), previous, None, candidate)
    seconds, kept = seconds + b.seconds, kept + b.device_bytes
    return Assignment(tuple(choices), seconds, fixed.device_bytes + static + max(kept + fixed.device_during, peak),
                      host)


def brute_force(cost: CostModel, candidate: Candidate, device_budget: float, host_budget: float) -> Assignment | None:
    """The best assignment within the budgets by trying every one (``None``: none fits)."""
    best = None
    for choices in itertools.product(*(cost.options(i, candidate) for i in range(len(cost.names())))):
        a = evaluate(cost, candidate, choices)
        if a.device_bytes <= device_budget and a.host_bytes <= host_budget and (best is None or a.seconds < best.seconds):
            best = a
    return best


@dataclasses.dataclass(frozen=True)
class Label:
    """A partial assignment (units ``0..len(choices)-1``): its seconds, device bytes held for
    the step (``static``), kept to backward (``kept``), the running peak (bytes kept so far
    plus a unit's workspace: ``peak``), and host bytes."""

    seconds: float
    static: int
    kept: int
    peak: int
    host: int
    choices: tuple[UnitChoice, ...]

    def dominates(self, other: "Label") -> bool:
        return (self.seconds <= other.seconds and self.static <= other.static and self.kept <= other.kept
                and self.peak <= other.peak and self.host <= other.host)


def dynamic_programming(cost: CostModel, candidate: Candidate, device_budget: float, host_budget: float,
                        max_labels: int = 256, resolution: int = 2000) -> Assignment | None:
    """The best assignment within the budgets (see the module docstring; ``None``: none fits)."""
    fixed = cost.fixed(candidate)
    n = len(cost.names())

    def fits(x: Label) -> bool:
        return fixed.device_bytes + x.static + max(x.kept + fixed.device_during, x.peak) <= device_budget \
            and x.host <= host_budget

    quantum = max(1.0, device_budget / resolution) if device_budget != float("inf") else 1.0
    frontier = frontiers(cost, candidate, 0, n, {None: [Label(fixed.seconds, 0, 0, 0, fixed.host_bytes, ())]}, fits,
                         max_labels, quantum)
    if not frontier:
        return None
    best = None
    for last, labels in frontier.items():
        b = cost.boundary(n, last, None, candidate)
        for label in labels:
            device = fixed.device_bytes + label.static + max(label.kept + b.device_bytes + fixed.device_during,
                                                             label.peak)
            if device > device_budget:
                continue
            if best is None or label.seconds + b.seconds < best.seconds:
                best = Assignment(label.choices, label.seconds + b.seconds, device, label.host)
    return best


def frontiers(cost: CostModel, candidate: Candidate, lo: int, hi: int, start: dict[UnitChoice | None, list[Label]],
              fits: Callable[[Label], bool], max_labels: int, quantum: float,
              pace: float = 1.0) -> dict[UnitChoice | None, list[Label]]:
    """The Pareto frontiers of the partial assignments ``start`` grown over units ``lo..hi-1``, by
    the last unit's option (a boundary's cost depends on both its sides); a label ``fits`` rejects
    is dropped (every part only grows: it never fits again). Empty: none fits. ``pace``: what a
    pipeline stretches each pass's work by (its fill and drain), not the optimizer updates."""
    frontier = start
    for i in range(lo, hi):
        grown: dict[UnitChoice | None, list[Label]] = {}
        options = [(c, cost.unit(i, c, candidate)) for c in cost.options(i, candidate)]
        for previous, labels in frontier.items():
            for choice, u in options:
                b = cost.boundary(i, previous, choice, candidate)
                for label in labels:
                    kept = label.kept + b.device_bytes
                    peak = max(label.peak, label.kept + b.device_during, kept + u.device_during)
                    work = (b.seconds + u.seconds - u.update_seconds) * pace + u.update_seconds
                    new = Label(label.seconds + work, label.static + u.device_static,
                                kept + u.device_kept, peak, label.host + u.host_bytes, label.choices + (choice,))
                    if fits(new):
                        grown.setdefault(choice, []).append(new)
        frontier = {c: pareto(labels, max_labels, quantum) for c, labels in grown.items()}
        if not frontier:
            break
    return frontier


def pareto(labels: list[Label], max_labels: int, quantum: float) -> list[Label]:
    """The labels no other dominates (sorted by seconds). Past ``max_labels``, bytes compare
    rounded up to ``quantum``, then to coarser multiples of it, until few enough remain: the
    frontier keeps its memory-lean labels (a feasible plan is never lost for its size)."""
    import numpy as np

    labels.sort(key=lambda x: (x.seconds, x.static + x.kept + x.peak + x.host))
    parts = np.array([(x.static, x.kept, x.peak, x.host) for x in labels], dtype=np.float64)
    keep = _undominated(parts)
    step = quantum
    while len(keep) > max_labels:
        keep = [keep[i] for i in _undominated(np.ceil(parts[keep] / step))]
        step *= 2
    return [labels[i] for i in keep]


def _undominated(parts, block: int = 256) -> list[int]:  # noqa: ANN001 - (n, 4) array, rows by seconds
    """Indices of the rows no earlier row is at most in every column (a row's seconds are no
    less than every earlier row's: being at most in bytes too makes the earlier one dominate).

    Rows go in blocks: each is checked against the rows kept before its block, then against the
    earlier rows of its own block, kept or not - one that is itself dominated has a kept row
    before it at most in every column, which is then at most in this row's too.
    """
    import numpy as np

    def at_most(a, b):  # noqa: ANN001, ANN202 - [i, j]: a's row j at most b's row i in every column
        out = a[None, :, 0] <= b[:, None, 0]
        for c in range(1, a.shape[1]):  # column by column: numpy reduces a short last axis slowly
            out &= a[None, :, c] <= b[:, None, c]
        return out

    kept: list[int] = []
    frontier = np.empty((0, parts.shape[1]))
    for lo in range(0, len(parts), block):
        rows = parts[lo:lo + block]
        dominated = at_most(frontier, rows).any(axis=1)
        dominated |= np.tril(at_most(rows, rows), -1).any(axis=1)  # earlier rows of the block only
        fresh = np.flatnonzero(~dominated)
        kept += (fresh + lo).tolist()
        frontier = np.vstack([frontier, rows[fresh]])
    return kept


def ilp(cost: CostModel, candidate: Candidate, device_budget: float, host_budget: float,
        retries: int = 3) -> Assignment | None:
    """The best assignment within the budgets as a mixed-integer program on HiGHS
    (``scipy.optimize.milp``; see the module docstring). ``None``: none fits."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(cost.names())
    fixed = cost.fixed(candidate)
    options = [[(c, cost.unit(i, c, candidate)) for c in cost.options(i, candidate)] for i in range(n)]
    x = {(i, k): j for j, (i, k) in enumerate((i, k) for i in range(n) for k in range(len(options[i])))}
    pairs = {(i, a, b): len(x) + j for j, (i, a, b) in enumerate(
        (i, a, b) for i in range(1, n) for a in range(len(options[i - 1])) for b in range(len(options[i])))}
    peak = len(x) + len(pairs)
    nv = peak + 1
    budget = device_budget if 0 < device_budget < float("inf") else 1e6
    scale = 1.0 / budget  # bytes as fractions of the budget: moderate coefficients for the solver
    c = np.zeros(nv)
    kept_boundary = [np.zeros(nv) for _ in range(n + 1)]  # kept bytes of boundary i (as rows)
    during_boundary = [np.zeros(nv) for _ in range(n + 1)]
    kept_unit = [np.zeros(nv) for _ in range(n)]
    during = [np.zeros(nv) for _ in range(n)]
    device, host = np.zeros(nv), np.zeros(nv)
    for (i, k), j in x.items():
        choice, u = options[i][k]
        ends = cost.boundary(0, None, choice, candidate) if i == 0 else None
        tail = cost.boundary(n, choice, None, candidate) if i == n - 1 else None
        c[j] = u.seconds + (ends.seconds if ends else 0.0) + (tail.seconds if tail else 0.0)
        kept_unit[i][j] = u.device_kept * scale
        if ends:
            kept_boundary[0][j] = ends.device_bytes * scale
            during_boundary[0][j] = ends.device_during * scale
        if tail:
            kept_boundary[n][j] = tail.device_bytes * scale
        during[i][j] = u.device_during * scale
        device[j], host[j] = u.device_static * scale, u.host_bytes * scale
    for (i, a, b), j in pairs.items():
        bc = cost.boundary(i, options[i - 1][a][0], options[i][b][0], candidate)
        c[j] = bc.seconds
        kept_boundary[i][j] = bc.device_bytes * scale
        during_boundary[i][j] = bc.device_during * scale
    rows, lo, hi = [], [], []

    def add(r: np.ndarray, low: float, high: float) -> None:
        rows.append(r), lo.append(low), hi.append(high)

    for i in range(n):  # one option per unit
        r = np.zeros(nv)
        for k in range(len(options[i])):
            r[x[i, k]] = 1
        add(r, 1, 1)
    for (i, a, b), j in pairs.items():  # z >= x_a + x_b - 1: the pair is on when both sides are
        r = np.zeros(nv)
        r[x[i - 1, a]], r[x[i, b]], r[j] = 1, 1, -1
        add(r, -np.inf, 1)
    prefix = np.zeros(nv)
    for i in range(n):  # peak >= everything kept before unit i's backward (boundary i included) + its backward
        r = prefix + during_boundary[i]  # (and, in forward, before boundary i + what it hands over)
        r[peak] = -1
        add(r, -np.inf, 0)
        prefix = prefix + kept_boundary[i]
        r = prefix + during[i]
        r[peak] = -1
        add(r, -np.inf, 0)
        prefix = prefix + kept_unit[i]
    total = prefix + kept_boundary[n]
    total[peak] = -1
    add(total, -np.inf, -fixed.device_during * scale)  # peak >= everything kept + the loss's backward
    device[peak] = 1
    add(device, -np.inf, (device_budget - fixed.device_bytes) * scale)
    add(host, -np.inf, (host_budget - fixed.host_bytes) * scale)
    integrality = np.r_[np.ones(len(x)), np.zeros(len(pairs) + 1)]
    bounds = Bounds(np.zeros(nv), np.r_[np.ones(len(x) + len(pairs)), np.inf])
    result = milp(c, integrality=integrality, bounds=bounds, constraints=LinearConstraint(np.array(rows), lo, hi))
    if result.x is None:
        return None
    choices = [options[i][max(range(len(options[i])), key=lambda k: result.x[x[i, k]])][0] for i in range(n)]
    found = evaluate(cost, candidate, choices)
    over = max(found.device_bytes - device_budget, 0), max(found.host_bytes - host_budget, 0)
    if any(over) and retries:  # within the solver's tolerance but over: the budgets are hard
        return ilp(cost, candidate, device_budget - 2 * over[0], host_budget - 2 * over[1], retries - 1)
    return None if any(over) else found


@dataclasses.dataclass
class _Delegating:
    """A cost model answering as ``inner`` does (what a wrapper does not change)."""

    inner: CostModel

    def names(self) -> list[str]:
        return self.inner.names()

    def options(self, i: int, c: Candidate) -> tuple[UnitChoice, ...]:
        return self.inner.options(i, c)

    def unit(self, i: int, choice: UnitChoice, c: Candidate) -> UnitCost:
        return self.inner.unit(i, choice, c)

    def boundary(self, i: int, before: UnitChoice | None, after: UnitChoice | None, c: Candidate) -> BoundaryCost:
        return self.inner.boundary(i, before, after, c)

    def fixed(self, c: Candidate) -> FixedCost:
        return self.inner.fixed(c)


@dataclasses.dataclass
class Biased(_Delegating):
    """A cost model whose recomputed, streamed or host units, moved tables and host/device switches cost
    more (the search's tie-break): a recompute (streaming, a dense unit on the host) ``tolerance`` of the unit's seconds, tables moved to the
    device or the SSD tier that of the unit's host tables, a switch that of the mean unit's (a host unit inside a
    stretch of device units, and the reverse, then loses a tie)."""

    inner: MeasuredCost
    tolerance: float
    means: dict[Candidate, float] = dataclasses.field(default_factory=dict)  # a dense unit's mean seconds

    def unit(self, i: int, choice: UnitChoice, c: Candidate) -> UnitCost:
        u = self.inner.unit(i, choice, c)
        if choice.device_tables or choice.ssd_tables:  # tables moved (to the device, the SSD tier) cost a tolerance of their host work
            host = self.inner.unit(i, UnitChoice(Target.HOST), c).seconds
            return dataclasses.replace(u, seconds=u.seconds + self.tolerance * host)
        changed = choice.recompute or choice.weights is Target.HOST or \
            (choice.target is Target.HOST and not self.inner.units[i].tables)
        return dataclasses.replace(u, seconds=u.seconds * (1 + self.tolerance)) if changed else u

    def _mean(self, c: Candidate) -> float:
        if c not in self.means:
            dense = [j for j, u in enumerate(self.inner.units) if not u.tables]
            self.means[c] = sum(self.inner.unit(j, UnitChoice(), c).seconds for j in dense) / max(len(dense), 1)
        return self.means[c]

    def boundary(self, i: int, before: UnitChoice | None, after: UnitChoice | None, c: Candidate) -> BoundaryCost:
        b = self.inner.boundary(i, before, after, c)
        on = [x.target if x is not None else Target.DEVICE for x in (before, after)]
        if on[0] is on[1] or (i < len(self.inner.units) and self.inner.units[i].tables) or \
                (i > 0 and self.inner.units[i - 1].tables):
            return b
        return dataclasses.replace(b, seconds=b.seconds + self.tolerance * self._mean(c))


@dataclasses.dataclass
class SecondsOnly(_Delegating):
    """A cost model's seconds without its bytes: a search of it under no budget finds the least
    seconds of any assignment - a lower bound on every budgeted search of the same candidate,
    which lets the planner skip the candidates whose bound loses (branch and bound). Its
    frontiers hold one label per last option: the bound costs a fraction of a search."""

    def unit(self, i: int, choice: UnitChoice, c: Candidate) -> UnitCost:
        u = self.inner.unit(i, choice, c)
        return UnitCost(u.seconds, update_seconds=u.update_seconds)

    def boundary(self, i: int, before: UnitChoice | None, after: UnitChoice | None, c: Candidate) -> BoundaryCost:
        return BoundaryCost(self.inner.boundary(i, before, after, c).seconds)

    def fixed(self, c: Candidate) -> FixedCost:
        return FixedCost(self.inner.fixed(c).parts)
