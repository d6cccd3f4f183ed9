"""The records of the SSD tier: a row's record layout (:class:`RecordLayout` of :class:`Field`),
records read ahead of their use (:class:`StagedRecords`), and the tier's compiled kernels
(:func:`io_kernels`)."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import numpy as np
import torch

from hetero._numba import load


def io_kernels() -> ModuleType:
    """The compiled I/O and cache kernels (:mod:`hetero.storage._kernels`)."""
    return load("hetero.storage._kernels")


@dataclasses.dataclass(frozen=True)
class Field:
    """One part of a record: ``width`` values of ``dtype`` per row; ``scalar``: one value per
    row, held as a ``(rows,)`` array (row-wise Adagrad's sum)."""

    name: str
    dtype: torch.dtype
    width: int = 1
    scalar: bool = False

    @property
    def nbytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size() * self.width

    def shape(self, rows: int) -> tuple[int, ...]:
        return (rows,) if self.scalar else (rows, self.width)


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """The fields of a record, in order: the row first, then the optimizer's state."""

    fields: tuple[Field, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    def offset(self, name: str) -> int:
        """Byte offset of field ``name`` in a record."""
        at = 0
        for f in self.fields:
            if f.name == name:
                return at
            at += f.nbytes
        raise KeyError(f"no field {name!r} in records of {[f.name for f in self.fields]}")


@dataclasses.dataclass
class StagedRecords:
    """Records read ahead of their use (:meth:`RowFile.stage`), on a prefetch worker: ``rows``
    (sorted int64), the file slots they were read from, those slots' segment generations then, and
    the records (``(len(rows), record_bytes)`` uint8). A record is used only while its row's slot
    and that slot's generation are unchanged (:meth:`RowFile.load`): any write of the row since
    (a write-back, the cleaner's move, a loaded checkpoint) gives it a new slot, and a slot is only
    written again after its segment was freed (a new generation), so a record that passes the check
    is the row's current one, byte for byte."""

    file: Any  # the RowFile they were read from
    rows: np.ndarray
    slots: np.ndarray
    generations: np.ndarray
    records: np.ndarray
