"""``hetero data prepare``: a raw file encoded once into a columnar cache of memory-mapped arrays,
so later epochs (and later jobs) skip decoding and encoding.

Layout of a cache directory (written under a temporary name, renamed when complete: a cache that
exists is whole)::

    manifest.json          format, source, the job it was prepared from (``job``: data path, split,
                           reader, schema, seed: a training job is checked against it), per
                           split: rows, each file's CRC-32; feature layout; id dtype
    encoding.json, vocabularies.parquet     the fitted schema (hetero.data.encode.save_encoding)
    <split>/ids.bin        (N, F) int32 or int64, row-major: the single-valued features' ids
    <split>/dense.bin      (N, K) float32 (K = 0: an empty file)
    <split>/label.bin      (N,) float32
    <split>/bag<i>.values.bin, bag<i>.offsets.bin    the i-th multi-hot feature (jagged); files are
                           named by position, never by a feature's name (which may hold "/" or "..")

Loading verifies every file's CRC-32 against the manifest (one read of the cache) before a row is
used: a cache changed or damaged on disk is refused, naming the file.

Row-major ids make a shuffled batch one gather per sample (a row of ``F`` ids), not one per
feature: measured 9.5M vs 2.5M rows/s on this project's 2-core VM for 26 features.

Splits: files of their own, or :meth:`hetero.data.split.Split.assign`'s seeded draw per row in
file order - the one definition of a random split, which the in-memory path uses too: the same
rows land in the same part whichever way the file is read. The schema is fitted on the
training rows only (a first pass, skipped when nothing needs fitting). A time-ordered split
needs the rows sorted, which a stream cannot do: sort the file and give the parts as files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetero.data.encode import Encoding, Fitter, load_encoding, save_encoding
from hetero.data.reader_config import ReaderConfig, reader_from_dict, reader_to_dict
from hetero.data.readers import record_batches
from hetero.data.split import Split
from hetero.data.schema import Schema, schema_from_dict, schema_to_dict
from hetero.data.toml_values import plain_data
from hetero.data.tabular import Batch, Feature, Jagged, TabularDataset

MANIFEST = "manifest.json"
FORMAT_VERSION = 3  # 2: files by position, a CRC-32 per file; 3: the job it was prepared from
SPLITS = ("train", "valid", "test")


def prepare(path: str | Path, schema: Schema, out: str | Path, reader: ReaderConfig = ReaderConfig(),
            split: Split = Split(), seed: int = 0, block_bytes: int = 1 << 22) -> Path:
    """Encode ``path`` (and ``split``'s validation/test files) into the cache directory ``out``.

    Raises:
        FileExistsError: ``out`` exists (nothing is overwritten).
        ValueError: a split by a time column; and every reader error (naming file, row, column,
            value); nothing is left behind then.
    """
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists: remove it or give another output directory")
    if split.time_column is not None:
        raise ValueError("prepare streams the file and cannot sort it by a time column: sort it, cut it into "
                         "train/validation/test files and give valid_path and test_path")
    if split.valid_path is not None:
        sources = [(path, "train", reader), (split.valid_path, "valid", split.reader_of("valid", reader)),
                   (split.test_path, "test", split.reader_of("test", reader))]
    else:  # a random split of the file (of its train and validation rows, when the test rows are a file's)
        sources = [(path, None, reader)]
        sources += [] if split.test_path is None else [(split.test_path, "test", split.reader_of("test", reader))]

    def parts(s: Split, fit_only: bool = False) -> Iterator[tuple[str, Any]]:
        """(split name, record batch) in file order; random splits by per-row draws."""
        for file, name, read in sources:
            if fit_only and name not in (None, "train"):
                continue
            rng = np.random.default_rng(seed)
            for batch in record_batches(file, schema, read, block_bytes=block_bytes):
                if name is not None:
                    yield name, batch
                    continue
                which = s.assign(rng, batch.num_rows)  # draws continue across blocks: one per row, in file order
                for k, part in enumerate(SPLITS):
                    mask = which == k
                    if mask.any():
                        yield part, batch.filter(mask) if not mask.all() else batch

    fitter = Fitter(schema)
    if fitter.vocab_columns or fitter.moments:
        for name, batch in parts(split, fit_only=True):
            if name == "train":
                fitter.add(batch, str(path))
    encoding = fitter.encoding()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        writers = {name: _SplitWriter(tmp / name, encoding) for name in SPLITS}
        for name, batch in parts(split):
            writers[name].write(encoding.encode(batch, f"{path} ({name} split)"))
        save_encoding(encoding, tmp)
        manifest = {"format_version": FORMAT_VERSION, "source": str(path), "seed": seed,
                    "reader": reader_to_dict(reader),  # how the source was read: a run's predict reads files so too
                    "job": prepared_job_document(path, schema, reader, split, seed),
                    "splits": {name: w.close() for name, w in writers.items()}}
        empty = [name for name, info in manifest["splits"].items() if not info["rows"]]
        if empty:
            raise ValueError(f"{path}: the {empty[0]} split has no rows; give a larger file or other fractions")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def prepared_job_document(path: str | Path | tuple, schema: Schema, reader: ReaderConfig, split: Split,
                          seed: int) -> dict[str, Any]:
    """What decides a cache's rows, as JSON-able data: ``data.path``, ``data.split``,
    ``data.reader``, ``schema`` and ``training.seed`` (only a random split draws with it)."""
    paths = [str(p) for p in path] if isinstance(path, (tuple, list)) else str(path)
    return {"data.path": paths, "data.split": plain_data(split), "data.reader": reader_to_dict(reader),
            "schema": schema_to_dict(schema), "training.seed": seed if split.valid_path is None else None}


@dataclasses.dataclass(frozen=True)
class PreparedJob:
    """The job a cache was prepared from (its manifest's ``job``): what a training job on it uses."""

    path: Path | tuple[Path, ...]
    split: Split
    reader: ReaderConfig
    schema: Schema
    seed: int | None  # None: a split by files (no seed draws it)
    document: dict[str, Any]  # (:func:`prepared_job_document`)


def prepared_job(directory: str | Path) -> PreparedJob:
    """The job a cache was prepared from.

    Raises:
        FileNotFoundError, ValueError: not a cache of this format (as :func:`load_prepared`).
    """
    doc = _manifest(Path(directory))["job"]
    p = doc["data.path"]
    split = doc["data.split"]
    split = Split(tuple(split["fractions"]), split["time_column"],
                  *(None if split[k] is None else Path(split[k]) for k in ("valid_path", "test_path")),
                  time_format=split.get("time_format"),
                  **{k: reader_from_dict(split[k]) for k in ("valid_reader", "test_reader") if split.get(k)})
    return PreparedJob(tuple(Path(x) for x in p) if isinstance(p, list) else Path(p), split,
                       reader_from_dict(doc["data.reader"]), schema_from_dict(doc["schema"], f"{directory} schema"),
                       doc["training.seed"], doc)


class _SplitWriter:
    """Appends encoded blocks to a split's files; ``close`` returns its manifest entry."""

    def __init__(self, directory: Path, encoding: Encoding) -> None:
        directory.mkdir()
        self.dir, self.specs = directory, encoding.specs()
        self.single = [f.name for f in self.specs if not f.multi_hot]
        self.bags = [f.name for f in self.specs if f.multi_hot]
        small = max((f.vocab_size for f in self.specs), default=0) < 2**31 and not any(f.dynamic for f in self.specs)
        self.id_dtype = np.int32 if small else np.int64  # (a dynamic feature's ids are 64-bit keys)
        self.files = {"ids": open(directory / "ids.bin", "wb"), "dense": open(directory / "dense.bin", "wb"),
                      "label": open(directory / "label.bin", "wb")}
        for i, b in enumerate(self.bags):
            self.files[f"{b}.values"] = open(directory / f"bag{i}.values.bin", "wb")
            self.files[f"{b}.offsets"] = open(directory / f"bag{i}.offsets.bin", "wb")
        self.rows, self.values, self.num_dense = 0, {b: 0 for b in self.bags}, 0
        self.crcs = {key: 0 for key in self.files}
        for b in self.bags:
            self._append(f"{b}.offsets", np.zeros(1, dtype=np.int64))

    def _append(self, key: str, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).tobytes()
        self.files[key].write(data)
        self.crcs[key] = zlib.crc32(data, self.crcs[key])

    def write(self, part: TabularDataset) -> None:
        ids = np.stack([part.features[n].numpy() for n in self.single], axis=1) if self.single else \
            np.zeros((len(part), 0))
        blocks = {"ids": ids.astype(self.id_dtype), "dense": part.dense.numpy(), "label": part.label.numpy()}
        for b in self.bags:
            bag = part.features[b]
            blocks[f"{b}.values"] = bag.values.numpy()
            blocks[f"{b}.offsets"] = (bag.offsets[1:] + self.values[b]).numpy()
            self.values[b] += int(bag.offsets[-1])
        for key, array in blocks.items():
            self._append(key, array)
        self.rows, self.num_dense = self.rows + len(part), part.dense.shape[1]

    def close(self) -> dict[str, Any]:
        for f in self.files.values():
            f.close()
        crc = {Path(f.name).name: self.crcs[key] for key, f in self.files.items()}
        return {"rows": self.rows, "crc": crc, "single": self.single, "bags": self.bags,
                "id_dtype": np.dtype(self.id_dtype).name, "num_dense": self.num_dense, "bag_values": self.values}


@dataclasses.dataclass
class PreparedDataset:
    """One split of a prepared cache, memory-mapped: the :class:`~hetero.data.tabular.Rows` that
    :class:`~hetero.data.tabular.Batches` shuffles, and the evaluation data of a trainer.
    Pages are read by the OS as batches touch them; memory holds what the page cache keeps.

    Attributes:
        directory: the split's directory; ``info``: its manifest entry; ``specs``: the features.
    """

    directory: Path
    info: dict[str, Any]
    specs: tuple[Feature, ...]

    def __post_init__(self) -> None:
        n, info = self.info["rows"], self.info
        _verify(self.directory, info["crc"])

        def mapped(name: str, dtype: Any, shape: tuple[int, ...], writable: bool = True) -> np.ndarray:  # noqa: ANN401
            # copy-on-write mappings ("c"): torch takes them without a read-only warning; nothing
            # writes. An empty array (no dense column, no rows) has an empty file, which mmap refuses.
            if not int(np.prod(shape)):
                return np.zeros(shape, dtype=dtype)
            return np.memmap(self.directory / name, dtype=dtype, mode="c" if writable else "r", shape=shape)

        self.ids = torch.from_numpy(mapped("ids.bin", info["id_dtype"], (n, len(info["single"]))))
        self.dense = torch.from_numpy(mapped("dense.bin", np.float32, (n, info["num_dense"])))
        self.label = torch.from_numpy(mapped("label.bin", np.float32, (n,)))
        self.bags = {b: (mapped(f"bag{i}.values.bin", np.int64, (info["bag_values"][b],), False),
                         mapped(f"bag{i}.offsets.bin", np.int64, (n + 1,), False))
                     for i, b in enumerate(info["bags"])}

    def __len__(self) -> int:
        return self.info["rows"]

    @property
    def num_dense(self) -> int:
        return self.info["num_dense"]

    @property
    def multi_hot(self) -> tuple[str, ...]:
        return tuple(self.info["bags"])

    def fingerprint(self) -> int:
        """CRC-32 of the split's files' CRC-32s (of every byte written, computed by prepare)."""
        return zlib.crc32(json.dumps(self.info["crc"], sort_keys=True).encode())

    def select(self, index: torch.Tensor) -> Batch:
        """The samples at ``index`` (int64 ``(M,)``): one gather of ``M`` rows of ids, dense
        values and labels from the mapped files (a copy into memory)."""
        i = index.numpy()
        ids = self.ids.index_select(0, index)  # the copy out of the mapping: one row of ids per sample
        columns = ids.long().t().contiguous().unbind(0)  # one (F, M) int64 block: each feature's row a view
        features: dict[str, torch.Tensor | Jagged] = dict(zip(self.info["single"], columns))
        for b, (values, offsets) in self.bags.items():
            starts, ends = offsets[i], offsets[i + 1]
            lengths = torch.from_numpy(ends - starts)
            out = torch.zeros(len(i) + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=out[1:])
            where = np.repeat(starts - out[:-1].numpy(), lengths.numpy()) + np.arange(int(out[-1]))
            features[b] = Jagged(torch.from_numpy(values[where].astype(np.int64)), out)
        return Batch(features, self.dense.index_select(0, index), self.label.index_select(0, index))

    def batches(self, size: int) -> Iterator[Batch]:
        for at in range(0, len(self), size):
            yield self.select(torch.arange(at, min(at + size, len(self))))


def load_prepared(directory: str | Path) -> tuple[PreparedDataset, PreparedDataset, PreparedDataset, Encoding]:
    """The train, validation and test splits of a cache :func:`prepare` wrote, and its encoding
    (:func:`prepared_reader`: the reader settings its source was read with).

    Raises:
        FileNotFoundError: not a prepared cache (no manifest).
    """
    directory = Path(directory)
    manifest = _manifest(directory)
    encoding = load_encoding(directory)
    specs = encoding.specs()
    train, valid, test = (PreparedDataset(directory / name, manifest["splits"][name], specs) for name in SPLITS)
    return train, valid, test, encoding


def _manifest(directory: Path) -> dict[str, Any]:
    if not (directory / MANIFEST).is_file():
        raise FileNotFoundError(f"{directory} is not a prepared cache (no {MANIFEST}): write one with `hetero data "
                                f"prepare --config job.toml --out {directory}`")
    manifest = json.loads((directory / MANIFEST).read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory} is a prepared cache of format {manifest.get('format_version')}; this hetero reads "
                         f"format {FORMAT_VERSION}: prepare it again (hetero data prepare)")
    return manifest


def _verify(directory: Path, crcs: dict[str, int], chunk: int = 1 << 22) -> None:
    """Check each file of a split against its CRC-32 in the manifest (one sequential read).

    Raises:
        ValueError: a file missing or whose bytes differ, naming it and the fix.
    """
    for name, want in crcs.items():
        path = directory / name
        if not path.is_file():
            raise ValueError(f"prepared cache file {path} is missing: prepare the cache again (hetero data prepare)")
        crc = 0
        with open(path, "rb") as f:
            while block := f.read(chunk):
                crc = zlib.crc32(block, crc)
        if crc != want:
            raise ValueError(f"prepared cache file {path} does not match its checksum in {MANIFEST} (changed or damaged "
                             f"on disk): prepare the cache again (hetero data prepare)")


def prepared_reader(directory: str | Path) -> ReaderConfig:
    """The reader settings a cache's source was read with (its manifest's)."""
    return reader_from_dict(json.loads((Path(directory) / MANIFEST).read_text())["reader"])
