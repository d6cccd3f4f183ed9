"""Reader for the Criteo Display Advertising Challenge (Kaggle) / Criteo Terabyte TSV format.

Each line: ``label``, 13 integer features ``I1..I13``, 26 categorical features ``C1..C26`` (hashed
32-bit values written as 8 hex digits), tab-separated; any feature may be empty.

* Dense: ``log(1 + max(x, 0))`` (the DLRM preprocessing), 0 when empty.
* Categorical, ``hash_buckets=H``: id ``1 + value mod (H - 1)`` (value = the hex token as an integer,
  or its CRC-32 if it is not hex); id 0 = empty. Every table then has ``H`` rows.
* Categorical, vocabulary mode (``hash_buckets=None``): per field, tokens seen at least
  ``min_count`` times get ids ``1..n`` in sorted order; rarer tokens and empty fields get 0.

The reader holds the file in memory: it is meant for samples such as Kaggle's first rows; the
Terabyte set needs a streaming pipeline.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections import Counter
from pathlib import Path

import torch

from hetero.data.tabular import Feature, FeatureRole, TabularDataset

NUM_DENSE, NUM_SPARSE = 13, 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
SPARSE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))


@dataclasses.dataclass(frozen=True)
class CriteoConfig:
    hash_buckets: int | None = None  # None: vocabulary mode
    min_count: int = 1
    max_rows: int | None = None


def _token_value(token: str) -> int:
    try:
        return int(token, 16)
    except ValueError:
        return zlib.crc32(token.encode())


def read_criteo_tsv(path: str | Path, config: CriteoConfig = CriteoConfig()) -> TabularDataset:
    """Read a Criteo TSV file into a :class:`TabularDataset` (26 single-valued features, 13 dense).

    Raises:
        ValueError: a line with other than 40 fields, a label other than 0/1, a non-integer
            integer feature, or ``hash_buckets < 2``; the message gives the file and line number.
    """
    path = Path(path)
    if config.hash_buckets is not None and config.hash_buckets < 2:
        raise ValueError(f"hash_buckets must be >= 2 (bucket 0 is reserved for empty fields), got {config.hash_buckets}")
    labels, dense, tokens = [], [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if config.max_rows is not None and len(labels) >= config.max_rows:
                break
            fields = line.rstrip("\r\n").split("\t")
            if len(fields) != NUM_FIELDS:
                raise ValueError(
                    f"{path}:{lineno}: expected {NUM_FIELDS} tab-separated fields (label, 13 integer, "
                    f"26 categorical), got {len(fields)}"
                )
            if fields[0] not in ("0", "1"):
                raise ValueError(f"{path}:{lineno}: label must be 0 or 1, got {fields[0]!r}")
            labels.append(float(fields[0]))
            row = []
            for j, text in enumerate(fields[1 : 1 + NUM_DENSE], start=1):
                if not text:
                    row.append(0.0)
                    continue
                try:
                    row.append(math.log1p(max(int(text), 0)))
                except ValueError:
                    raise ValueError(f"{path}:{lineno}: integer feature I{j} is {text!r}, not an integer") from None
            dense.append(row)
            tokens.append(fields[1 + NUM_DENSE :])

    columns = list(zip(*tokens)) if tokens else [() for _ in SPARSE_NAMES]
    features, specs = {}, []
    for name, col in zip(SPARSE_NAMES, columns):
        if config.hash_buckets is not None:
            h = config.hash_buckets
            ids = [1 + _token_value(t) % (h - 1) if t else 0 for t in col]
            vocab_size = h
        else:
            counts = Counter(t for t in col if t)
            vocab = {t: i + 1 for i, t in enumerate(sorted(t for t, c in counts.items() if c >= config.min_count))}
            ids = [vocab.get(t, 0) for t in col]
            vocab_size = len(vocab) + 1
        features[name] = torch.tensor(ids, dtype=torch.int64)
        specs.append(Feature(name, vocab_size, role=FeatureRole.WIDE_AND_DEEP))
    dense_t = torch.tensor(dense, dtype=torch.float32).reshape(len(labels), NUM_DENSE)
    return TabularDataset(features, dense_t, torch.tensor(labels, dtype=torch.float32), tuple(specs))
