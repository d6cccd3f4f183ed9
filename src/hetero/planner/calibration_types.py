"""The rates a calibration holds: a :class:`Curve` of seconds by work, an optimizer's
:class:`LinearRate`, a table group's :class:`TableRate`."""

from __future__ import annotations

import dataclasses
import math
import statistics


@dataclasses.dataclass(frozen=True)
class Curve:
    """Seconds as a function of an amount of work (FLOPs, bytes, elements): measured points,
    piecewise linear in log-log space between them, proportional to the work beyond the largest
    and the smallest point's time below it (a fixed cost dominates small work)."""

    points: tuple[tuple[float, float], ...]

    def seconds(self, work: float) -> float:
        pts = self.points
        if work <= pts[0][0]:
            return pts[0][1]
        if work >= pts[-1][0]:
            return pts[-1][1] * work / pts[-1][0]
        lw = math.log(work)
        for (w0, s0), (w1, s1) in zip(pts, pts[1:]):
            if work <= w1:
                f = (lw - math.log(w0)) / (math.log(w1) - math.log(w0))
                return math.exp(math.log(s0) + f * (math.log(s1) - math.log(s0)))
        return pts[-1][1]  # pragma: no cover - the loop always returns

    @staticmethod
    def through(points: list[tuple[float, float]]) -> "Curve":
        """A curve through ``points`` (work, seconds); points of equal work are averaged."""
        merged: dict[float, list[float]] = {}
        for w, s in points:
            merged.setdefault(float(w), []).append(max(float(s), 1e-9))
        return Curve(tuple((w, statistics.fmean(v)) for w, v in sorted(merged.items())))


@dataclasses.dataclass(frozen=True)
class LinearRate:
    """Seconds = ``fixed + per_element * elements + per_tensor * tensors`` (an optimizer step)."""

    fixed: float
    per_element: float
    per_tensor: float

    def seconds(self, elements: float, tensors: float) -> float:
        return max(0.0, self.fixed + self.per_element * elements + self.per_tensor * tensors) if elements else 0.0


@dataclasses.dataclass(frozen=True)
class TableRate:
    """A table group's step with one sparse optimizer (one kernel call per group and pass, and
    Python work per table): a pass's lookup and backward take ``lookup_fixed + lookup_per_table
    * tables + lookup_per_id_element * ids * dim``, the step's update ``update_fixed +
    update_per_table * tables + (update_per_row_element * rows + update_per_id_element * ids) *
    dim`` (``rows``: the distinct rows updated)."""

    lookup_fixed: float
    lookup_per_table: float
    lookup_per_id_element: float
    update_fixed: float
    update_per_table: float
    update_per_row_element: float
    update_per_id_element: float

    def seconds(self, passes: int, tables: int, ids_per_pass: float, rows: float, dim: int) -> float:
        lookups = passes * (self.lookup_fixed + self.lookup_per_table * tables +
                            self.lookup_per_id_element * ids_per_pass * dim)
        return lookups + self.update_fixed + self.update_per_table * tables + \
            (self.update_per_row_element * rows + self.update_per_id_element * ids_per_pass * passes) * dim
