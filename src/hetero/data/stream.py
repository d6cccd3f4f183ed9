"""Training from a file larger than memory: a CSV/TSV file streamed in record batches, encoded
on a reader thread, shuffled within windows, sharded over ranks by bytes, resumable at a sample.

* **Shards:** rank ``r`` of ``W`` reads the rows that start in bytes ``[c_r, c_{r+1})`` of a
  line-format file, the cuts ``c`` spread evenly and moved to line starts (:func:`~hetero.data.shards.byte_shards`),
  or row groups ``[c_r, c_{r+1})`` of a Parquet file, cut where the rows before are closest to
  ``r / W`` of them (:func:`~hetero.data.shards.file_shards`): disjoint, covering, and each rank decodes only its
  part. Fields may not hold newlines (pyarrow's default).
* **Order:** a shard's rows are cut into windows of ``shuffle_window`` rows; window ``k`` of epoch
  ``e`` is permuted by a generator seeded by ``(seed, e, rank, k)``, and local batches of
  ``batch_size / W`` rows are cut from the permuted windows in turn. Memory holds a window, the
  reader's queue and pyarrow's blocks - not the file.
* **Position:** ``epoch(e, start=k)`` yields exactly the batches ``epoch(e)`` yields from batch
  ``k`` on: the windows before the position are decoded but not encoded, the one holding it is
  permuted as before and its first rows dropped. A checkpoint resumes at the same world size
  (the shards depend on it; the run's identity records it).
* **Global batches:** shards hold unequal row counts, so every step sums the ranks' batch sizes
  (one all-reduce of an int64 over ``group``): a rank whose shard is done contributes empty
  batches until every rank is, and the global size weighs the loss
  (:func:`hetero.parallel.global_batch_mean`). Nothing is dropped or repeated.

Thread contract: the reader thread runs pyarrow's decoder and the numba hash kernel, both of
which release the GIL; it hands finished chunks over a bounded queue (``read_ahead``) and stops
when the consumer stops iterating. Reference: tf.data's and torchdata's interleaved shuffle
buffers; Hadoop's line-aligned byte splits.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import zlib
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hetero.data.encode import Encoding, Fitter
from hetero.data.files import source_files
from hetero.data.reader_config import FileFormat, ReaderConfig
from hetero.data.readers import empty_batch, file_columns, record_batches
from hetero.data.rows import BadRowCount
from hetero.data.shards import ends_crc, file_shards
from hetero.data.schema import Schema
from hetero.data.tabular import Batch, BatchConfig, Jagged, TabularDataset
from hetero.placement.threads import host_thread


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """How a file is streamed.

    Attributes:
        block_bytes: text decoded per pyarrow block (bytes); also the granularity of the reader
            thread's hand-over.
        shuffle_window: rows permuted together (a larger window shuffles better and holds more
            memory: about ``shuffle_window`` x the encoded row's bytes).
        read_ahead: encoded blocks queued between the reader thread and training (bounds memory).
    """

    block_bytes: int = 1 << 20
    shuffle_window: int = 1 << 17
    read_ahead: int = 8

    def __post_init__(self) -> None:
        if self.block_bytes < 1 << 12 or self.shuffle_window < 1 or self.read_ahead < 1:
            raise ValueError(f"stream config {self}: block_bytes >= 4096, shuffle_window >= 1 and read_ahead >= 1")


class StreamBatches:
    """This rank's batches of a file streamed under a fitted :class:`Encoding` (see the module
    docstring); the :class:`~hetero.data.tabular.TrainingData` a :class:`hetero.train.Trainer` takes.

    Args:
        path: a CSV/TSV, libsvm, libFM, libFFM or Parquet file, or several
            (:func:`~hetero.data.files.source_files`: a directory, a glob, a list; compressed
            line files in one process); every rank reads its part of each file.
        encoding: the schema fitted on the training data (e.g. :func:`fit_stream`).
        reader: how the file is read.
        batches: the global batch size, seed, ``rank`` and ``world_size`` (``shuffle=False``
            streams in file order; ``drop_last`` is not supported).
        config: the :class:`StreamConfig`.
        group: the process group summing batch sizes (a gloo group for host tensors; ``None``:
            the default group). Unused at world size 1.

    Raises:
        ValueError: ``drop_last``, or a world size that does not divide the batch size.
    """

    def __init__(self, path: str | Path, encoding: Encoding, reader: ReaderConfig, batches: BatchConfig,
                 config: StreamConfig = StreamConfig(), group: dist.ProcessGroup | None = None) -> None:
        if batches.drop_last:
            raise ValueError("a stream keeps its last partial batch (drop_last=False): shards end unevenly")
        if batches.batch_size <= 0 or batches.batch_size % batches.world_size:
            raise ValueError(f"global batch size {batches.batch_size} must be a positive multiple of the world size "
                             f"{batches.world_size} (each rank gets batch_size / world_size)")
        self.path = tuple(Path(p) for p in path) if isinstance(path, (list, tuple)) else Path(path)
        self.encoding, self.reader, self.config, self.stream = encoding, reader, batches, config
        self.group = group
        self.files = source_files(self.path)
        # each rank's part: its byte range (or row groups) of every file; one process: the files whole
        # (compressed ones too: only a byte-sharded read needs a file it can seek in)
        self.ranges = [(f, file_shards(f, reader, batches.world_size)[batches.rank] if batches.world_size > 1 else None)
                       for f in self.files]
        self.bad = BadRowCount()
        self.empty = encoding.encode(empty_batch(encoding.schema), str(self.path)).select(torch.arange(0))

    @property
    def num_samples(self) -> int | None:
        return None  # unknown until read

    @property
    def multi_hot(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.encoding.specs() if f.multi_hot)

    def identity(self) -> dict[str, Any]:
        """The file (path, size, CRC-32 of its first and last MiB), the encoding's fingerprint,
        the world size and the shuffle window: what names the samples behind a position."""
        c = self.config
        crc = 0
        for f in self.files:
            crc = zlib.crc32(ends_crc(f).to_bytes(4, "little"), crc)
        return {"batch_size": c.batch_size, "seed": c.seed, "shuffle": c.shuffle, "drop_last": c.drop_last,
                "stream": [str(f) for f in self.files] if len(self.files) > 1 else str(self.files[0]),
                "stream_bytes": sum(f.stat().st_size for f in self.files), "stream_crc": crc,
                "encoding": self.encoding.fingerprint(), "world_size": self.config.world_size,
                "shuffle_window": self.stream.shuffle_window}

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """This rank's part of global batches ``start, start + 1, ...`` of ``epoch``; every rank
        iterates until the last rank's shard is done (a collective per batch).

        Raises:
            ValueError: the file has no rows (an epoch from its start yields nothing), the first
                epoch's rows are of one class (found at its end, before its evaluation), or as
                :func:`~hetero.data.readers.record_batches`.
        """
        # the batches are cut and gathered on a thread of their own: training only takes them
        local = _Background(lambda: self._local(epoch, start), self.stream.read_ahead)
        first, rows, positives = True, 0, 0
        try:  # (closed early too - a max_steps stop: the threads and the file go with it)
            while True:
                batch = next(local, None)
                # the batch's rows and positives (the latter: a stream's one-class check, below)
                n = torch.tensor([len(batch), int(batch.label.sum())] if batch is not None else [0, 0], dtype=torch.int64)
                if self.config.world_size > 1:
                    dist.all_reduce(n, group=self.group)  # sync point: the global batch's size weighs the loss
                if int(n[0]) == 0:
                    if start == 0 and first:  # a whole epoch of nothing: never a silent no-op
                        raise ValueError(f"{self.path} has no rows to train on (every rank's shard is empty): give a "
                                         f"file with data rows")
                    if start == 0 and epoch == 0 and positives in (0, rows):  # (before the epoch's evaluation and checkpoint)
                        label = self.encoding.schema.label
                        raise ValueError(f"{self.path} (the training file): all {rows} rows are "
                                         f"{'negative' if positives == 0 else 'positive'} by the label column "
                                         f"{label.column!r}: check the label's rule in the schema (positive = [...], "
                                         f"negative = [...], threshold)")
                    return
                first = False
                rows, positives = rows + int(n[0]), positives + int(n[1])
                if batch is None:
                    batch = _copy(self.empty)
                batch.global_size = int(n[0])
                yield batch
        finally:
            local.close()

    def _local(self, epoch: int, start: int) -> Iterator[Batch]:
        c, window = self.config, self.stream.shuffle_window
        b = c.batch_size // c.world_size
        first = start * b // window  # the window holding the position
        drop = start * b - first * window  # its rows before the position
        rows = _Background(lambda: self._encoded(first * window), self.stream.read_ahead)
        rest: TabularDataset | None = None  # the last window's rows not yet batched (< b)
        try:
            for k, part in enumerate(_windows(rows, window), start=first):
                order = torch.arange(len(part))
                if c.shuffle:  # batches gather the window's rows in this order (no permuted copy)
                    seed = (c.seed * 1_000_003 + epoch) * 1_000_003 + c.rank
                    g = torch.Generator().manual_seed(zlib.crc32(np.array([seed, k], dtype=np.int64).tobytes()))
                    order = torch.randperm(len(part), generator=g)
                order, drop = order[drop:], 0
                at = 0
                if rest is not None:
                    at = min(b - len(rest), len(order))
                    rest = TabularDataset.concat([rest, part.subset(order[:at])])
                    if len(rest) < b:
                        continue
                    yield rest.select(torch.arange(b))
                    rest = None
                packed = _Packed(part)
                while len(order) - at >= b:
                    yield packed.select(order[at : at + b])
                    at += b
                if at < len(order):
                    rest = part.subset(order[at:])
            if rest is not None and len(rest):
                yield rest.select(torch.arange(len(rest)))
        finally:
            rows.close()

    def _encoded(self, skip: int) -> Iterator[TabularDataset]:
        if len(self.ranges) == 1:
            f, shard = self.ranges[0]
            return encoded_blocks(f, self.encoding, self.reader, shard, self.stream, skip, self.bad)
        return self._chained(skip)

    def _chained(self, skip: int) -> Iterator[TabularDataset]:
        """This rank's part of every file in turn, from its row ``skip`` on (the rows before it are
        encoded to be counted: on a resume only)."""
        for f, shard in self.ranges:
            for block in encoded_blocks(f, self.encoding, self.reader, shard, self.stream, 0, self.bad):
                if skip >= len(block):
                    skip -= len(block)
                    continue
                yield block.subset(torch.arange(skip, len(block))) if skip else block
                skip = 0


def encoded_blocks(path: str | Path, encoding: Encoding, reader: ReaderConfig, shard: tuple[int, int] | None = None,
                   config: StreamConfig = StreamConfig(), skip: int = 0,
                   bad: BadRowCount | None = None) -> Generator[TabularDataset, None, None]:
    """The rows of ``path`` (or of its ``shard``, :func:`~hetero.data.shards.file_shards`) from row ``skip`` on, encoded, a block at a
    time; the rows before ``skip`` are decoded to be counted, not encoded. Decoding runs on a
    thread of its own (pyarrow's decoder releases the GIL), so it overlaps the encoding here.

    Raises:
        ValueError: as :func:`~hetero.data.readers.record_batches`.
    """
    unit = "row groups" if reader.format is FileFormat.PARQUET else "bytes"
    source = f"{path}" if shard is None else f"{path} ({unit} {shard[0]}-{shard[1]})"

    def decoded() -> Iterator:
        rows = skip
        for batch in record_batches(path, encoding.schema, reader, shard=shard,
                                    block_bytes=config.block_bytes, bad=bad):
            if rows >= batch.num_rows:
                rows -= batch.num_rows
                continue
            if rows:
                batch, rows = batch.slice(rows), 0
            yield batch

    blocks = _Background(decoded, config.read_ahead)
    try:
        for batch in blocks:
            yield encoding.encode(batch, source)
    finally:
        blocks.close()


class StreamEval:
    """A validation or test file streamed whole, in file order, on every rank (the metrics of a
    replicated model need every sample once): ``batches(size)`` for :meth:`Trainer.evaluate`."""

    def __init__(self, path: str | Path, encoding: Encoding, reader: ReaderConfig,
                 config: StreamConfig = StreamConfig()) -> None:
        self.path = tuple(Path(p) for p in path) if isinstance(path, (list, tuple)) else Path(path)
        self.encoding, self.reader, self.stream = encoding, reader, config
        for f in source_files(self.path):
            if not f.is_file():
                raise FileNotFoundError(f"data file {f} does not exist")

    def batches(self, size: int) -> Iterator[Batch]:
        rows = _Background(self._encoded, self.stream.read_ahead)
        try:  # blocks regrouped into batches of exactly ``size`` rows (the last one shorter)
            for part in _windows(rows, size):
                yield part.select(torch.arange(len(part)))
        finally:
            rows.close()

    def _encoded(self) -> Iterator[TabularDataset]:
        return encoded_blocks(self.path, self.encoding, self.reader, config=self.stream)


def fit_stream(path: str | Path, schema: Schema, reader: ReaderConfig,
               config: StreamConfig = StreamConfig()) -> Encoding:
    """:func:`~hetero.data.encode.fit` over a training file streamed in blocks (memory: the
    distinct values of the vocabulary columns); no pass at all when every categorical column
    is hashed and no dense column is standardised."""
    fitter = Fitter(schema)
    if fitter.vocab_columns or fitter.moments:
        for batch in record_batches(path, schema, reader, block_bytes=config.block_bytes):
            fitter.add(batch, str(path))
    else:
        schema.check(file_columns(path, reader), str(path))
    return fitter.encoding()


class _Packed:
    """A window whose single-valued ids are packed row-major ``(N, F)``: a batch is one gather of
    ``F`` contiguous ids per sample, not ``F`` gathers of one id (measured: 1.3x the batched rows/s)."""

    def __init__(self, part: TabularDataset) -> None:
        self.part = part
        self.single = [k for k, v in part.features.items() if not isinstance(v, Jagged)]
        self.ids = torch.stack([part.features[k] for k in self.single], dim=1) if self.single else None

    def select(self, index: torch.Tensor) -> Batch:
        features: dict[str, torch.Tensor | Jagged] = {}
        if self.ids is not None:
            features.update(zip(self.single, self.ids.index_select(0, index).t().contiguous().unbind(0)))
        bags = {k: v.select(index) for k, v in self.part.features.items() if isinstance(v, Jagged)}
        features = {k: features[k] if k in features else bags[k] for k in self.part.features}  # the dataset's order
        return Batch(features, self.part.dense.index_select(0, index), self.part.label.index_select(0, index))


def _windows(rows: Iterator[TabularDataset], size: int) -> Iterator[TabularDataset]:
    """Blocks of rows regrouped into windows of exactly ``size`` rows (the last one shorter)."""
    parts, n = [], 0
    for part in rows:
        while len(part):
            take = min(size - n, len(part))
            parts.append(part if take == len(part) else part.subset(torch.arange(take)))
            part = part.subset(torch.arange(take, len(part))) if take < len(part) else part.subset(torch.arange(0))
            n += take
            if n == size:
                yield TabularDataset.concat(parts)
                parts, n = [], 0
    if n:
        yield TabularDataset.concat(parts)


class _Background(Iterator):
    """``make()``'s items, produced on a daemon thread into a queue of ``depth`` items; the
    thread's exception is raised here; ``close()`` stops it."""

    _END = object()

    def __init__(self, make: Callable[[], Iterator], depth: int) -> None:
        self.queue: queue.Queue = queue.Queue(depth)
        self.stop = threading.Event()
        # (its OpenMP team sized beside a CPU device's: hetero.placement.threads)
        self.thread = host_thread(functools.partial(self._run, make), "hetero-stream")

    def _run(self, make: Callable[[], Iterator]) -> None:
        items = make()
        try:
            for item in items:
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(e)
        finally:
            if isinstance(items, Generator):  # closed: its own finally stops the stages it started
                items.close()

    def _put(self, item: object) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> Any:  # noqa: ANN401 - the generator's item
        item = self.queue.get()
        if item is self._END:
            self.queue.put(self._END)  # a later next() ends too
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _copy(batch: Batch) -> Batch:
    return Batch(dict(batch.features), batch.dense, batch.label)
