"""Typed configuration of host tables: :class:`TableConfig` and :class:`Pooling`."""

from __future__ import annotations

import dataclasses
import enum

import torch


class Pooling(enum.Enum):
    """How the embeddings of one bag (a multi-hot feature of one sample) are combined."""

    NONE = "none"  # one output row per id
    SUM = "sum"
    MEAN = "mean"


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    Attributes:
        name: table name; used in error messages, checkpoints and optimizer state.
        num_embeddings: vocab size (rows). Valid ids are ``0 <= id < num_embeddings``.
        embedding_dim: row width ``D`` (1 for the wide part of Wide & Deep).
        feature: key of the input feature this table looks up (defaults to ``name``).
        pooling: how bags are pooled (:class:`Pooling`).
        hashed: map any int64 id into range with ``id mod num_embeddings`` (the hashing trick)
            instead of raising :class:`IndexError` for out-of-range ids.
        init_std: rows are initialised from ``N(0, init_std**2)``; 0 gives a zero table.
        dtype: storage dtype of the table: ``torch.float32`` (default), ``torch.bfloat16`` or
            ``torch.float16``. Optimizer state is fp32 and updates are computed in fp32.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature: str | None = None
    pooling: Pooling = Pooling.NONE
    hashed: bool = False
    init_std: float = 0.01
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_embeddings <= 0 or self.embedding_dim <= 0:
            raise ValueError(
                f"table {self.name!r}: num_embeddings and embedding_dim must be positive, got "
                f"{self.num_embeddings} x {self.embedding_dim}"
            )
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"table {self.name!r}: dtype must be float32, bfloat16 or float16, got {self.dtype}")
        if self.num_embeddings >= 1 << 32:
            raise ValueError(f"table {self.name!r}: at most 2**32 - 1 rows per table, got {self.num_embeddings}")

    @property
    def feature_name(self) -> str:
        return self.feature or self.name
