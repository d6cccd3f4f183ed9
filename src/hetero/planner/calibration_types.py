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
        """A curve through ``points`` (work, seconds); points of equal work are averaged, and a
        point faster than one of less work is raised to it (more work never takes less time:
        points of different shapes would otherwise make the curve's slope noise)."""
        merged: dict[float, list[float]] = {}
        for w, s in points:
            merged.setdefault(float(w), []).append(max(float(s), 1e-9))
        out, slowest = [], 0.0
        for w, v in sorted(merged.items()):
            slowest = max(slowest, statistics.fmean(v))
            out.append((w, slowest))
        return Curve(tuple(out))


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
    * tables + (lookup_per_id + lookup_per_id_element * dim) * ids``, the step's update
    ``update_fixed + update_per_table * tables + (update_per_row + update_per_row_element * dim)
    * rows + update_per_id_element * dim * ids`` (``rows``: the distinct rows updated; an id
    costs something whatever the row's width - a wide part's one-element rows too)."""

    lookup_fixed: float
    lookup_per_table: float
    lookup_per_id: float
    lookup_per_id_element: float
    update_fixed: float
    update_per_table: float
    update_per_row: float
    update_per_row_element: float
    update_per_id_element: float

    def seconds(self, passes: int, tables: int, ids_per_pass: float, rows: float, dim: int) -> float:
        lookups = passes * (self.lookup_fixed + self.lookup_per_table * tables +
                            (self.lookup_per_id + self.lookup_per_id_element * dim) * ids_per_pass)
        return lookups + self.update_fixed + self.update_per_table * tables + \
            (self.update_per_row + self.update_per_row_element * dim) * rows + \
            self.update_per_id_element * dim * ids_per_pass * passes


@dataclasses.dataclass(frozen=True)
class DiskRate:
    """A local disk as the SSD tier uses it (:mod:`hetero.planner.disk` measures it): seconds
    per record read at random - its misses, issued by the tier's I/O threads, the page cache
    dropped first - and per byte appended - its write-backs, sequential. A record of up to a
    4 KiB page costs one read whatever its size (``record_bytes``: the size measured)."""

    read_s: float
    write_s_per_byte: float
    record_bytes: int
