"""A table group's rows on the SSD tier: its record file under its row cache (:class:`SsdRows`).

The record layout is the row followed by the state of the group's sparse optimizer
(:meth:`SsdRows.for_state`). A group's rows are laid out when they are first needed: by its
optimizer (row and state), or earlier by a lookup or a loaded checkpoint (the row alone, then
re-laid out once, in one sequential pass, when the optimizer arrives).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from hetero.storage.cache import RowCache
from hetero.storage.config import SsdConfig
from hetero.checkpoint.io import CheckpointError
from hetero.storage import snapshot
from hetero.storage.layout import Field, RecordLayout
from hetero.storage.records import RowFile

CHUNK = 1 << 14  # rows per sequential pass step (initialisation, re-layout, assignment)
InitRows = Callable[[int, int], torch.Tensor]  # rows [lo, hi) of the group's weight, initial values


class SsdRows:
    """``rows`` rows of ``dim`` values of ``dtype`` with state ``state`` (name -> (scalar, initial
    value)) in a record store of ``config.directory`` under a :class:`RowCache`. Their first
    values: ``init(lo, hi)`` (rows), or ``records(lo, hi)`` (whole records), or the rows
    ``[first, first + rows)`` of ``previous``, which this replaces (another layout, or a shard
    of it: written beside it, then moved into its place).

    Thread contract: as :class:`RowCache`.

    Raises:
        ValueError: as :class:`RowCache` and :class:`RowFile`.
        OSError: a failed read or write, naming the file.
    """

    def __init__(self, name: str, rows: int, dim: int, dtype: torch.dtype, config: SsdConfig, init: InitRows | None,
                 state: Mapping[str, tuple[bool, float]] = {}, previous: "SsdRows | None" = None,
                 records: Callable[[int, int], np.ndarray] | None = None, first: int = 0) -> None:
        self.name, self.rows, self.dim, self.dtype, self.config = name, rows, dim, dtype, config
        self.state = dict(state)
        self.layout = layout(dtype, dim, state)
        config.directory.mkdir(parents=True, exist_ok=True)
        final = config.directory / f"{name}.rows"
        path = final if previous is None else final.with_suffix(".relayout")  # beside the old store until done
        if previous is not None:
            previous.cache.flush()
        source = (lambda lo, hi: previous._records_with(self.layout, self.state, lo + first, hi + first)) \
            if previous is not None \
            else records or (lambda lo, hi: self._initial(init, lo, hi))
        self._adopt(RowFile(path, self.layout, rows, config.io_threads, init=source, mapped_bytes=config.mapped_bytes))
        if previous is not None:
            previous.close()
            shutil.rmtree(final)
            os.replace(path, final)
            self.file.path = final

    def _adopt(self, file: RowFile) -> None:
        self.file = file
        capacity = max(1, self.config.cache_bytes // self.layout.nbytes)
        self.cache = RowCache(file, min(capacity, self.rows), self.config.policy)

    def read_in_pieces(self, rows: np.ndarray, out: torch.Tensor) -> None:
        """Copies of rows ``rows`` (int64, unique) into ``out`` ``(len(rows), dim)``, through the
        cache a cache's worth at a time: more rows than it holds, for a read no update follows
        (an evaluation or ``hetero predict`` batch). Each piece is resident until the next acquire,
        so it is copied out first."""
        for lo in range(0, rows.shape[0], self.cache.capacity):
            slots = torch.from_numpy(self.cache.acquire(rows[lo : lo + self.cache.capacity]))
            torch.index_select(self.cache.fields["weight"], 0, slots, out=out[lo : lo + self.cache.capacity])

    def checkpoint(self, dest: Path, first_row: int = 0) -> dict:
        """Write back the cache and snapshot the rows into the new directory ``dest``
        (:func:`hetero.storage.snapshot.write`: incremental, links to the sealed segments);
        ``first_row``: the global row of row 0 (a row-sharded group's shard). Returns the manifest."""
        self.cache.flush()
        return snapshot.write(self.file, dest, {"name": self.name, "dim": self.dim, "dtype": str(self.dtype),
                                                "state": self.state, "first_row": first_row})

    @classmethod
    def from_snapshots(cls, name: str, rows: int, dim: int, dtype: torch.dtype, config: SsdConfig,
                       parts: list[tuple[Path, dict]], first_row: int = 0,
                       state: Mapping[str, tuple[bool, float]] | None = None) -> "SsdRows":
        """Rows with ``state`` (default: the state they were saved with) from snapshots, as
        :meth:`restore`, without writing initial rows first."""
        self = cls.__new__(cls)
        self.name, self.rows, self.dim, self.dtype, self.config = name, rows, dim, dtype, config
        saved = {k: tuple(v) for k, v in parts[0][1]["extra"]["state"].items()} if parts else {}
        self.state = dict(state) if state is not None else saved
        self.layout = layout(dtype, dim, self.state)
        config.directory.mkdir(parents=True, exist_ok=True)
        self._restore(self._check(parts, first_row), first_row)
        return self

    def restore(self, parts: list[tuple[Path, dict]], first_row: int = 0) -> None:
        """Replace the rows (and state) by those of snapshots ``parts`` (directory, its verified
        manifest), which together hold global rows ``[first_row, first_row + rows)`` in this
        layout: a snapshot of exactly these rows is linked back; several, or another row range
        (a checkpoint of another world size), are read into a new store.

        Raises:
            CheckpointError: a snapshot of another layout (dtype, width, optimizer state), or
                rows no part holds; nothing is changed then.
        """
        spans = self._check(parts, first_row)  # (before anything changes)
        self.file.close()  # (its rows are replaced: the cache's updates too)
        self._restore(spans, first_row)

    def _check(self, parts: list[tuple[Path, dict]], first_row: int) -> list[tuple[int, int, Path, dict]]:
        """The parts by first row; raises :class:`CheckpointError` as :meth:`restore`."""
        for where, m in parts:
            if snapshot.layout_of(m) != self.layout:
                raise CheckpointError(f"the SSD tier's checkpoint {where} holds records of {snapshot.layout_of(m)}, "
                                      f"this run's are {self.layout}: resume with the run's tables and optimizer")
        spans = sorted((m["extra"]["first_row"], m["extra"]["first_row"] + m["rows"], w, m) for w, m in parts)
        if not spans or spans[0][0] > first_row or spans[-1][1] < first_row + self.rows or \
                any(a[1] < b[0] for a, b in zip(spans, spans[1:])):
            raise CheckpointError(f"the SSD tier's checkpoints {[str(w) for w, _ in parts]} do not hold rows "
                                  f"[{first_row}, {first_row + self.rows}) of {self.name}")
        return spans

    def _restore(self, spans: list[tuple[int, int, Path, dict]], first_row: int) -> None:
        """The store from the checked parts ``spans`` (:meth:`_check`)."""
        final = self.config.directory / f"{self.name}.rows"
        exact = [(w, m) for a, b, w, m in spans if a == first_row and b - a == self.rows]
        if exact:
            self._adopt(snapshot.restore(exact[0][0], final, self.config.io_threads, exact[0][1], self.config.mapped_bytes))
            return
        sources = []  # the parts this store's rows come from, linked into scratch stores to be read
        for k, (a, b, where, m) in enumerate(spans):
            if a < first_row + self.rows and b > first_row:
                sources.append((a, b, snapshot.restore(where, final.with_suffix(f".from{k}"), self.config.io_threads, m,
                                                       self.config.mapped_bytes)))

        def records(lo: int, hi: int) -> np.ndarray:
            out = np.empty((hi - lo, self.layout.nbytes), np.uint8)
            for a, b, file in sources:  # global rows [a, b) of each source
                s, e = max(a, first_row + lo), min(b, first_row + hi)
                if s < e:
                    part = np.empty((e - s, self.layout.nbytes), np.uint8)
                    file.read(np.arange(s - a, e - a, dtype=np.int64), part)
                    out[s - first_row - lo : e - first_row - lo] = part
            return out

        try:
            self._adopt(RowFile(final, self.layout, self.rows, self.config.io_threads, init=records,
                                mapped_bytes=self.config.mapped_bytes))
        finally:
            for _, _, file in sources:
                file.close()
                shutil.rmtree(file.path)

    def _initial(self, init: InitRows, lo: int, hi: int) -> np.ndarray:
        """Records ``[lo, hi)`` of initial rows and initial state."""
        records = np.empty((hi - lo, self.layout.nbytes), np.uint8)
        _put(records, self.layout, "weight", init(lo, hi))
        for s, (scalar, value) in self.state.items():
            f = next(f for f in self.layout.fields if f.name == s)
            _put(records, self.layout, s, torch.full(f.shape(hi - lo), value))
        return records

    def _records_with(self, layout: RecordLayout, state: Mapping[str, tuple[bool, float]], lo: int, hi: int) -> np.ndarray:
        """Records ``[lo, hi)`` of this file in ``layout``: fields this one has copied, new state initial."""
        mine = self.cache.read(np.arange(lo, hi, dtype=np.int64))
        records = np.empty((hi - lo, layout.nbytes), np.uint8)
        for f in layout.fields:
            _put(records, layout, f.name, mine[f.name] if f.name in mine else torch.full(f.shape(hi - lo), state[f.name][1]))
        return records

    @staticmethod
    def for_state(rows: "SsdRows", state: Mapping[str, tuple[bool, float]]) -> "SsdRows":
        """``rows`` laid out for ``state`` (itself when it already is)."""
        if rows.state == dict(state):
            return rows
        return SsdRows(rows.name, rows.rows, rows.dim, rows.dtype, rows.config, init=None, state=state, previous=rows)

    def reset(self, rows: np.ndarray, values: torch.Tensor) -> None:
        """Rows ``rows`` (unique int64) start afresh: their records become ``values`` (``(len(rows),
        dim)``, the rows' dtype) and each state's initial value - a dynamic table's rows given to new
        keys. Written in the cache (dirty: written back when given up, so a lookup that no update
        follows keeps them too).

        Raises:
            ValueError, OSError: as :meth:`RowCache.acquire`.
        """
        slots = self.cache.acquire(rows, used=False)
        at = torch.from_numpy(slots)
        for name, field in self.cache.fields.items():
            field[at] = values if name == "weight" else self.state[name][1]
        self.cache.mark_dirty(slots)

    def read(self, lo: int, hi: int, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Fields ``names`` (default: every one) of rows ``[lo, hi)``, current values (copies)."""
        return self.cache.read(np.arange(lo, hi, dtype=np.int64), names)

    def assign(self, name: str, lo: int, values: torch.Tensor) -> None:
        """Set field ``name`` of rows ``[lo, lo + len(values))`` (a loaded checkpoint): the cache is
        written back and emptied first, then the records are rewritten in sequential passes."""
        self.cache.flush()
        self.cache.clear()
        for a in range(0, values.shape[0], CHUNK):
            b = min(a + CHUNK, values.shape[0])
            ids = np.arange(lo + a, lo + b, dtype=np.int64)
            records = np.empty((b - a, self.layout.nbytes), np.uint8)
            self.file.read(ids, records)
            _put(records, self.layout, name, values[a:b])
            self.file.write(ids, records)

    def close(self) -> None:
        self.file.close()


def layout(dtype: torch.dtype, dim: int, state: Mapping[str, tuple[bool, float]]) -> RecordLayout:
    """The record of a row of ``dim`` values of ``dtype`` with ``state`` (name -> (one value per
    row, initial value)): the row, then each state in fp32."""
    return RecordLayout((Field("weight", dtype, dim),
                         *(Field(s, torch.float32, 1 if scalar else dim, scalar) for s, (scalar, _) in state.items())))


def _put(records: np.ndarray, layout: RecordLayout, name: str, values: torch.Tensor) -> None:
    at = layout.offset(name)  # (KeyError naming the layout's fields, for a field it does not have)
    f = next(f for f in layout.fields if f.name == name)
    src = values.detach().to(f.dtype).contiguous().reshape(values.shape[0], -1)
    raw = src.view(torch.int16) if f.dtype == torch.bfloat16 else src
    records[:, at : at + f.nbytes] = raw.numpy().view(np.uint8).reshape(values.shape[0], f.nbytes)
