"""Typed configuration of host tables: :class:`TableConfig` and :class:`Pooling`."""

from __future__ import annotations

import dataclasses
import enum
import re
import zlib

import torch
from torch import Tensor

from hetero.dynamic.config import DynamicConfig, Keys
from hetero.placement.target import StorageTier
from hetero.storage.config import SsdConfig

INIT_CHUNK = 4096  # rows per independently seeded block of the initialisation


_SAFE = re.compile(r"[A-Za-z0-9_]{1,64}")


def table_name(prefix: str, feature: str) -> str:
    """A table's name for a feature: ``<prefix>_<feature>``, used as a torch module name, a file name
    (export, SSD store) and a directory name, so it holds only ``[A-Za-z0-9_]``. A feature name
    of other characters (``user.id``, ``page/section``, ``..``) or longer than 64 is written with
    each other character as ``_``, cut to 48, and the CRC-32 of the whole name appended (two names
    never meet); the user's name stays the table's ``feature`` and is what outputs show."""
    if _SAFE.fullmatch(feature):
        return f"{prefix}_{feature}"
    return f"{prefix}_{re.sub(r'[^A-Za-z0-9_]', '_', feature)[:48]}_{zlib.crc32(feature.encode()):08x}"


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
        num_embeddings: vocab size (rows). Valid ids are ``0 <= id < num_embeddings``. For a
            dynamic table, its capacity: the most keys it holds rows for.
        embedding_dim: row width ``D`` (1 for the wide part of Wide & Deep).
        feature: key of the input feature this table looks up (defaults to ``name``).
        pooling: how bags are pooled (:class:`Pooling`).
        hashed: map any int64 id into range with ``id mod num_embeddings`` (the hashing trick)
            instead of raising :class:`IndexError` for out-of-range ids.
        init_std: rows are initialised from ``N(0, init_std**2)``; 0 gives a zero table.
        init_range: ``(low, high)``: rows are initialised from ``U(low, high)`` instead (TorchRec's
            initializer, ``weight_init_min`` / ``weight_init_max``); fixed tables only.
        dtype: storage dtype of the table: ``torch.float32`` (default), ``torch.bfloat16`` or
            ``torch.float16``. Optimizer state is fp32 and updates are computed in fp32.
        storage: where the rows and their optimizer state live: ``StorageTier.HOST_DRAM``
            (default) or ``StorageTier.SSD`` (a file on a local disk under a DRAM row cache, each
            row beside its sparse-optimizer state: :mod:`hetero.storage`).
        ssd: the SSD tier's directory, cache budget and policy (with ``StorageTier.SSD`` only;
            tables of one group share the group's file and cache: give them one ``SsdConfig``).
        keys: ``Keys.FIXED`` (ids are rows) or ``Keys.DYNAMIC``: ids are raw int64 keys, each
            admitted key given a row of its own (:mod:`hetero.dynamic`); the weight then has
            ``num_embeddings + 1`` rows, the last the default row that keys without a row read.
        dynamic: a dynamic table's admission and eviction (:class:`~hetero.dynamic.DynamicConfig`;
            ``None``: the defaults). Only with ``Keys.DYNAMIC``.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature: str | None = None
    pooling: Pooling = Pooling.NONE
    hashed: bool = False
    init_std: float = 0.01
    dtype: torch.dtype = torch.float32
    storage: StorageTier = StorageTier.HOST_DRAM
    ssd: SsdConfig | None = None
    keys: Keys = Keys.FIXED
    dynamic: DynamicConfig | None = None
    init_range: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.num_embeddings <= 0 or self.embedding_dim <= 0:
            raise ValueError(
                f"table {self.name!r}: num_embeddings and embedding_dim must be positive, got "
                f"{self.num_embeddings} x {self.embedding_dim}"
            )
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"table {self.name!r}: dtype must be float32, bfloat16 or float16, got {self.dtype}")
        if self.storage not in (StorageTier.HOST_DRAM, StorageTier.SSD):
            raise ValueError(f"table {self.name!r}: storage must be StorageTier.HOST_DRAM or StorageTier.SSD, got "
                             f"{self.storage}")
        if (self.storage is StorageTier.SSD) != (self.ssd is not None):
            raise ValueError(f"table {self.name!r}: a table on StorageTier.SSD takes an SsdConfig (ssd=), and only such "
                             f"a table does; got storage {self.storage.value} and ssd={self.ssd}")
        if self.init_range is not None and not (len(self.init_range) == 2 and self.init_range[0] <= self.init_range[1]):
            raise ValueError(f"table {self.name!r}: init_range is (low, high) with low <= high, got {self.init_range}")
        if self.num_embeddings >= 1 << 32:
            raise ValueError(f"table {self.name!r}: at most 2**32 - 1 rows per table, got {self.num_embeddings}")
        self._check_keys()

    def _check_keys(self) -> None:
        if not isinstance(self.keys, Keys):
            raise ValueError(f"table {self.name!r}: keys must be a Keys ({[k.value for k in Keys]}), got {self.keys!r}")
        if self.keys is Keys.FIXED:
            if self.dynamic is not None:
                raise ValueError(f"table {self.name!r}: dynamic= is a dynamic table's setting; add keys=Keys.DYNAMIC "
                                 f"or drop it")
            return
        if self.init_range is not None:
            raise ValueError(f"table {self.name!r}: a dynamic table's rows start from N(0, init_std**2) seeded by each key; "
                             f"drop init_range")
        if self.dynamic is None:
            object.__setattr__(self, "dynamic", DynamicConfig())
        if self.hashed:
            raise ValueError(f"table {self.name!r}: a dynamic table gives each key a row of its own; drop hashed=True")
        if self.num_embeddings >= (1 << 31) - 1:
            raise ValueError(f"table {self.name!r}: a dynamic table holds at most 2**31 - 2 rows, got "
                             f"num_embeddings = {self.num_embeddings}")
        self.dynamic.check(self.name, self.num_embeddings)

    @property
    def num_rows(self) -> int:
        """The rows of the table's weight: ``num_embeddings``, and a dynamic table's default row."""
        return self.num_embeddings + (self.keys is Keys.DYNAMIC)

    @property
    def feature_name(self) -> str:
        return self.feature or self.name


def init_rows(config: TableConfig, seed: int, lo: int, hi: int) -> Tensor:
    """Initial values of rows ``[lo, hi)`` of a table, ``(hi - lo, D)`` in ``config.dtype``.

    ``N(0, init_std**2)`` (zeros if ``init_std == 0``) or ``U(*init_range)``, drawn in fp32 per block of
    :data:`INIT_CHUNK` rows from a generator seeded by ``(seed, block)``, so a row's value does
    not depend on which process builds it or how the rows are split. A dynamic table's rows are
    zeros (a key's row takes its initial value on admission, ``KeyMap.init_rows``), but for its
    last, the default row: ``dynamic.default_value``.
    """
    out = torch.empty(hi - lo, config.embedding_dim)
    if config.keys is Keys.DYNAMIC:
        out.zero_()
        if lo <= config.num_embeddings < hi:
            out[config.num_embeddings - lo] = config.dynamic.default_value
        return out.to(config.dtype)
    if config.init_std <= 0 and config.init_range is None:
        return out.zero_().to(config.dtype)
    g = torch.Generator()
    for block in range(lo // INIT_CHUNK, -(-hi // INIT_CHUNK)):
        a = block * INIT_CHUNK
        b = min(a + INIT_CHUNK, config.num_embeddings)
        g.manual_seed((seed + block * 0x9E3779B97F4A7C15) % (1 << 63))
        rows = torch.empty(b - a, config.embedding_dim)
        if config.init_range is not None:
            rows.uniform_(*config.init_range, generator=g)
        else:
            rows.normal_(0.0, config.init_std, generator=g)
        s, e = max(a, lo), min(b, hi)
        out[s - lo : e - lo] = rows[s - a : e - a]
    return out.to(config.dtype)
