"""A table group's rows on the SSD tier: its record file under its row cache (:class:`SsdRows`).

The record layout is the row followed by the state of the group's sparse optimizer
(:meth:`SsdRows.for_state`). A group's rows are laid out when they are first needed: by its
optimizer (row and state), or earlier by a lookup or a loaded checkpoint (the row alone, then
re-laid out once, in one sequential pass, when the optimizer arrives).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import numpy as np
import torch

from hetero.storage.cache import RowCache
from hetero.storage.config import SsdConfig
from hetero.storage.records import Field, RecordLayout, RowFile

CHUNK = 1 << 14  # rows per sequential pass step (initialisation, re-layout, assignment)
InitRows = Callable[[int, int], torch.Tensor]  # rows [lo, hi) of the group's weight, initial values


class SsdRows:
    """``rows`` rows of ``dim`` values of ``dtype`` with state ``state`` (name -> (scalar, initial
    value)) in a record file of ``config.directory`` under a :class:`RowCache`.

    Thread contract: as :class:`RowCache`.

    Raises:
        ValueError: as :class:`RowCache` and :class:`RowFile`.
        OSError: a failed read or write, naming the file.
    """

    def __init__(self, name: str, rows: int, dim: int, dtype: torch.dtype, config: SsdConfig, init: InitRows,
                 state: Mapping[str, tuple[bool, float]] = {}, previous: "SsdRows | None" = None) -> None:
        self.name, self.rows, self.dim, self.dtype, self.config = name, rows, dim, dtype, config
        self.state = dict(state)
        self.layout = RecordLayout((Field("weight", dtype, dim),
                                    *(Field(s, torch.float32, 1 if scalar else dim, scalar) for s, (scalar, _) in state.items())))
        config.directory.mkdir(parents=True, exist_ok=True)
        final = config.directory / f"{name}.rows"
        path = final if previous is None else final.with_suffix(".relayout")  # beside the old file until done
        if path.exists():
            os.remove(path)  # a previous run's scratch file: this run starts from its own rows
        if previous is not None:
            previous.cache.flush()
        source = (lambda lo, hi: previous._records_with(self.layout, self.state, lo, hi)) if previous is not None \
            else (lambda lo, hi: self._initial(init, lo, hi))
        self.file = RowFile(path, self.layout, rows, config.io_threads, init=source)
        if previous is not None:
            previous.close()
            os.replace(path, final)
            self.file.path = final
        capacity = max(1, config.cache_bytes // self.layout.nbytes)
        self.cache = RowCache(self.file, min(capacity, rows), config.policy)

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


def _put(records: np.ndarray, layout: RecordLayout, name: str, values: torch.Tensor) -> None:
    at = layout.offset(name)  # (KeyError naming the layout's fields, for a field it does not have)
    f = next(f for f in layout.fields if f.name == name)
    src = values.detach().to(f.dtype).contiguous().reshape(values.shape[0], -1)
    raw = src.view(torch.int16) if f.dtype == torch.bfloat16 else src
    records[:, at : at + f.nbytes] = raw.numpy().view(np.uint8).reshape(values.shape[0], f.nbytes)
