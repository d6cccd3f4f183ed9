"""In-memory columnar datasets of sparse (categorical), multi-hot and dense features.

A dataset is a dict of feature columns (int64 ids, or :class:`Jagged` bags for multi-hot features),
a dense float matrix and a label vector, all on the host. :class:`Batches` cuts it into batches in
a deterministic order per epoch, so a training position ``(epoch, batch)`` names exactly the same
samples after a restart.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import zlib
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from hetero.dynamic import DynamicConfig


class Jagged(NamedTuple):
    """Variable-length bags in the jagged layout: ``values`` ``(total,)`` int64, ``offsets`` ``(N + 1,)``.

    Bag ``i`` is ``values[offsets[i]:offsets[i + 1]]``. Unpacks as ``(ids, offsets)``, the input of
    a pooled :class:`hetero.embedding.HostEmbedding`.
    """

    values: Tensor
    offsets: Tensor

    @staticmethod
    def from_lists(bags: list[list[int]]) -> "Jagged":
        lengths = torch.tensor([len(b) for b in bags], dtype=torch.int64)
        values = torch.tensor([v for b in bags for v in b], dtype=torch.int64)
        return Jagged(values, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))

    def __len__(self) -> int:  # type: ignore[override]  - number of bags, not tuple arity
        return self.offsets.numel() - 1

    def select(self, index: Tensor) -> "Jagged":
        """The bags at ``index`` (int64 ``(M,)``), in that order, as a new :class:`Jagged`."""
        starts = self.offsets[:-1][index]
        lengths = self.offsets[1:][index] - starts
        offsets = torch.zeros(index.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        # position of every output value in ``values``: its bag's start plus its rank in the bag
        shift = torch.repeat_interleave(starts - offsets[:-1], lengths, output_size=int(offsets[-1]))
        positions = shift + torch.arange(int(offsets[-1]))
        return Jagged(self.values[positions], offsets)


class FeatureRole(enum.Enum):
    """Which part of a Wide & Deep model a feature feeds."""

    WIDE_AND_DEEP = "wide_and_deep"
    WIDE = "wide"  # crossed features: memorisation only
    DEEP = "deep"


@dataclasses.dataclass(frozen=True)
class Feature:
    """A categorical feature: ``vocab_size`` ids in ``[0, vocab_size)``; id 0 means missing/unknown.
    A dynamic feature (``dynamic``: its admission and eviction) has int64 keys instead, and
    ``vocab_size`` rows of capacity."""

    name: str
    vocab_size: int
    multi_hot: bool = False
    role: FeatureRole = FeatureRole.WIDE_AND_DEEP
    dynamic: DynamicConfig | None = None


@dataclasses.dataclass
class Batch:
    """One batch on the host.

    Attributes:
        features: feature name -> int64 ``(B,)`` ids, or :class:`Jagged` bags for multi-hot features.
        dense: float32 ``(B, K)`` dense features (``K`` may be 0).
        label: float32 ``(B,)`` binary labels.
        global_size: samples in the global batch this batch is a rank's share of (``B`` when
            it is not a share); the divisor of the global batch's mean loss, see
            :func:`hetero.parallel.global_batch_mean`.
    """

    features: dict[str, Tensor | Jagged]
    dense: Tensor
    label: Tensor
    global_size: int = -1

    def __post_init__(self) -> None:
        if self.global_size < 0:
            self.global_size = self.label.numel()

    def __len__(self) -> int:
        return self.label.numel()


@dataclasses.dataclass
class TabularDataset:
    """Columns of ``N`` samples (see :class:`Batch` for shapes) plus their :class:`Feature` specs."""

    features: dict[str, Tensor | Jagged]
    dense: Tensor
    label: Tensor
    specs: tuple[Feature, ...]

    def __post_init__(self) -> None:
        n = self.label.numel()
        for name, col in self.features.items():
            if len(col) != n:
                raise ValueError(f"feature {name!r} has {len(col)} rows, label has {n}")
        if self.dense.shape[0] != n:
            raise ValueError(f"dense features have {self.dense.shape[0]} rows, label has {n}")

    def __len__(self) -> int:
        return self.label.numel()

    @property
    def num_dense(self) -> int:
        return self.dense.shape[1]

    @property
    def multi_hot(self) -> tuple[str, ...]:
        return tuple(k for k, v in self.features.items() if isinstance(v, Jagged))

    def batches(self, size: int) -> Iterator[Batch]:
        """The samples in order, ``size`` at a time (evaluation)."""
        for i in range(0, len(self), size):
            yield self.select(torch.arange(i, min(i + size, len(self))))

    def fingerprint(self) -> int:
        """CRC-32 of the labels, dense features and ids (columns in name order): another file,
        vocabulary or split gives another value. One pass over the data."""
        crc = 0
        columns = [self.label, self.dense]
        for name in sorted(self.features):
            col = self.features[name]
            columns += [col.values, col.offsets] if isinstance(col, Jagged) else [col]
        for c in columns:
            if c.numel():  # (no dense column: an (N, 0) block, whose bytes are none)
                crc = zlib.crc32(memoryview(c.contiguous().numpy()).cast("B"), crc)  # read in place, no copy
        return crc

    def select(self, index: Tensor) -> Batch:
        feats = {k: (v.select(index) if isinstance(v, Jagged) else v[index]) for k, v in self.features.items()}
        return Batch(feats, self.dense[index], self.label[index])

    def subset(self, index: Tensor) -> "TabularDataset":
        b = self.select(index)
        return TabularDataset(b.features, b.dense, b.label, self.specs)

    @staticmethod
    def concat(parts: "list[TabularDataset]") -> "TabularDataset":
        """The rows of ``parts`` (same features and specs) in order, as one dataset."""
        if len(parts) == 1:
            return parts[0]
        features: dict[str, Tensor | Jagged] = {}
        for name, col in parts[0].features.items():
            cols = [p.features[name] for p in parts]
            if isinstance(col, Jagged):
                sizes = [int(c.offsets[-1] - c.offsets[0]) for c in cols]  # values per part
                starts = [sum(sizes[:i]) for i in range(len(cols))]
                offsets = torch.cat([torch.zeros(1, dtype=torch.int64)] +
                                    [c.offsets[1:] - c.offsets[0] + s for c, s in zip(cols, starts)])
                features[name] = Jagged(torch.cat([c.values[int(c.offsets[0]):int(c.offsets[-1])] for c in cols]), offsets)
            else:
                features[name] = torch.cat(cols)
        return TabularDataset(features, torch.cat([p.dense for p in parts]), torch.cat([p.label for p in parts]),
                              parts[0].specs)

    def split(self, fractions: tuple[float, ...], seed: int) -> list["TabularDataset"]:
        """Seeded random split into consecutive parts of the given fractions (e.g. 0.8, 0.1, 0.1)."""
        if abs(sum(fractions) - 1.0) > 1e-9 or any(f <= 0 for f in fractions):
            raise ValueError(f"split fractions must be positive and sum to 1, got {fractions}")
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        bounds = [0] + [round(len(self) * sum(fractions[: i + 1])) for i in range(len(fractions))]
        return [self.subset(perm[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


class Rows(Protocol):
    """Samples addressable by index (:class:`TabularDataset`, a prepared cache's split): what
    :class:`Batches` shuffles."""

    def __len__(self) -> int: ...

    def select(self, index: Tensor) -> Batch:
        """The samples at ``index`` (int64 ``(M,)``), in that order."""
        ...

    def fingerprint(self) -> int:
        """A checksum naming the data (another file, vocabulary or split gives another)."""
        ...

    @property
    def multi_hot(self) -> tuple[str, ...]: ...


class EvalData(Protocol):
    """Samples a trainer scores (validation, test): a :class:`TabularDataset`, a streamed file
    (:class:`hetero.data.stream.StreamEval`), a prepared cache's split."""

    def batches(self, size: int) -> Iterator[Batch]:
        """Every sample once, in a fixed order, at most ``size`` per batch."""
        ...


class TrainingData(Protocol):
    """The training batches a :class:`hetero.train.Trainer` takes: :class:`Batches` (in memory
    or over a prepared cache) or :class:`hetero.data.stream.StreamBatches` (a file streamed).

    Attributes:
        config: the batching (global batch size, seed, rank, world size).
    """

    config: "BatchConfig"

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """This rank's part of global batches ``start, start + 1, ...`` of ``epoch``; the same
        batches after a restart (the exact resumable position)."""
        ...

    def identity(self) -> dict[str, Any]:
        """What names the samples behind a position (saved in checkpoints; a resume that
        differs is refused)."""
        ...

    @property
    def num_samples(self) -> int | None:
        """Samples per epoch; ``None`` when unknown before reading (a stream)."""
        ...

    @property
    def multi_hot(self) -> tuple[str, ...]:
        """The multi-hot features (bags)."""
        ...


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """``batch_size`` is the global batch; with ``world_size`` ranks each rank gets
    ``batch_size / world_size`` of it, interleaved: sample ``i`` of the epoch's order goes to rank
    ``i mod world_size`` (the reference design's ``num_shards``/``shard_id``). ``drop_last`` drops
    the final partial batch (``drop_remainder``); kept, its shares are unequal and may be empty
    (97 samples, batch 16, 4 ranks: 1, 0, 0, 0), so losses must be weighted by the global batch
    (``Batch.global_size``, :func:`hetero.parallel.global_batch_mean`), never averaged per rank."""

    batch_size: int = 256
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    rank: int = 0
    world_size: int = 1


class Batches:
    """Deterministic, resumable batching: epoch ``e`` is a permutation seeded by ``(seed, e)``.

    ``epoch(e, start=k)`` yields the same batches as ``epoch(e)`` from batch ``k`` on, which is what
    a mid-epoch resume needs.
    """

    def __init__(self, dataset: Rows, config: BatchConfig) -> None:
        """Raises ``ValueError`` for a non-positive batch size, a bad rank, or a world size that
        does not divide the batch size."""
        if config.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {config.batch_size}")
        if not 0 <= config.rank < config.world_size:
            raise ValueError(f"rank {config.rank} is outside world size {config.world_size}")
        if config.batch_size % config.world_size:
            raise ValueError(f"global batch size {config.batch_size} is not divisible by world size {config.world_size}; "
                             f"use a multiple of {config.world_size} (each rank gets batch_size / world_size)")
        self.dataset, self.config = dataset, config
        self._fingerprint: int | None = None

    @property
    def num_samples(self) -> int:
        return len(self.dataset)

    @property
    def multi_hot(self) -> tuple[str, ...]:
        return self.dataset.multi_hot

    def identity(self) -> dict[str, Any]:
        """The batching config and the data (size and fingerprint, computed once)."""
        if self._fingerprint is None:
            self._fingerprint = self.dataset.fingerprint()
        return {"batch_size": self.config.batch_size, "seed": self.config.seed, "shuffle": self.config.shuffle,
                "drop_last": self.config.drop_last, "train_samples": len(self.dataset), "train_crc": self._fingerprint}

    def __len__(self) -> int:
        n, b = len(self.dataset), self.config.batch_size
        return n // b if self.config.drop_last else math.ceil(n / b)

    def order(self, epoch: int) -> Tensor:
        n = len(self.dataset)
        if not self.config.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.config.seed * 1_000_003 + epoch))

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """This rank's part of global batches ``start, start + 1, ...`` of ``epoch``."""
        order, b, c = self.order(epoch), self.config.batch_size, self.config
        for i in range(start, len(self)):
            samples = order[i * b : (i + 1) * b]
            batch = self.dataset.select(samples[c.rank :: c.world_size])
            batch.global_size = samples.numel()
            yield batch
