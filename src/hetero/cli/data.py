"""The command line's data side: a job's training, validation and test data from its
:class:`~hetero.config.job.JobConfig` (in memory, streamed, or a prepared cache), and
``hetero data prepare``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hetero.data import BatchConfig
from hetero.data.encode import Encoding
from hetero.data.reader_config import ReaderConfig
from hetero.data.rows import BadRowCount
from hetero.data.prepare import load_prepared, prepare, prepared_job, prepared_job_document, prepared_reader
from hetero.data.split import read_dataset
from hetero.data.stream import StreamBatches, StreamConfig, StreamEval, fit_stream
from hetero.data.tabular import EvalData, Feature, Rows
from hetero.config.job import JobConfig
from hetero.config.manager import locate
from hetero.config.toml import read_job_file
from hetero.parallel.env import DataParallelGroup
from hetero.record import first_difference


@dataclasses.dataclass
class JobData:
    """A job's data: the training rows (in memory or a prepared cache) or stream, the
    validation and test data, the features, and the fitted encoding of a schema job."""

    train: Rows | StreamBatches
    valid: EvalData
    test: EvalData
    specs: tuple[Feature, ...]
    num_dense: int
    encoding: Encoding | None = None
    reader: ReaderConfig = ReaderConfig()  # how the job's files were read (predict reads files so too)
    bad: BadRowCount | None = None  # the rows skipped as bad (None: not counted here: a prepared cache's)


def job_path(job: JobConfig) -> Path | tuple[Path, ...]:
    """The job's main data (its paths located: see :func:`hetero.config.manager.locate`).

    Raises:
        ValueError: the job names no data.
    """
    if job.data.path is None:
        raise ValueError(f"{job.config or 'the job'} names no data: set path in its [data] section, or --data-path")
    return job.data.path


def with_prepared(job: JobConfig) -> JobConfig:
    """A job on a prepared cache (``data.prepared``) with the cache's data path, split, reader
    settings and schema, so that the run's record and ``config.toml`` say what it trains on. A job
    that describes data itself (a ``[schema]`` or a data path) must describe the cache's: its
    located paths, split, reader settings and schema are compared with those the cache was
    prepared from, and a random split's seed with ``training.seed``. Other jobs are returned as they are.

    Raises:
        ValueError: the first key that differs, with both values and the fix.
    """
    d = job.data
    if d.prepared is None:
        return job
    cache = prepared_job(d.prepared)
    ours = prepared_job_document(cache.path if d.path is None else d.path, cache.schema if job.schema is None else
                                 job.schema, d.reader, d.split, job.training.seed)
    if job.schema is None and d.path is None:  # the job names no data: the cache's own settings are the job's
        ours = {**cache.document, "training.seed": ours["training.seed"]}
    if cache.seed is None:
        ours["training.seed"] = None  # a split by files: no seed draws it
    if ours != cache.document:
        key = next(k for k in cache.document if cache.document[k] != ours[k])
        what = first_difference(cache.document[key], ours[key], key, ("in the cache", "in this job"))
        fix = "--seed " + str(cache.seed) if key == "training.seed" else "the job file the cache was prepared from"
        raise ValueError(f"--prepared {d.prepared} was prepared from another job ({what}): train with {fix}, or "
                         f"prepare a cache of this job (hetero data prepare)")
    data = dataclasses.replace(d, path=cache.path, split=cache.split, reader=cache.reader)
    return dataclasses.replace(job, data=data, schema=cache.schema)


def job_data(job: JobConfig, dp: DataParallelGroup = DataParallelGroup()) -> JobData:
    """A prepared cache (``data.prepared``), else the job's schema over its data, streamed
    (``data.stream``: each rank of ``dp`` its share of every file) or read, fitted on the
    training split. ``job``'s paths are located (:func:`hetero.config.manager.locate`)."""
    d = job.data
    if d.prepared is not None:
        train, valid, test, encoding = load_prepared(d.prepared)
        _check_two_classes(train, f"{d.prepared} (its training split)", encoding)
        return JobData(train, valid, test, encoding.specs(), train.num_dense, encoding, prepared_reader(d.prepared))
    if job.schema is None:
        raise ValueError("hetero train needs data: --config job.toml with [data] and [schema] (examples/movielens.toml "
                         "is the demo's), or --prepared DIR")
    path, reader = job_path(job), d.reader
    if d.stream:
        split = d.split
        if split.valid_path is None:
            raise ValueError(f"--stream reads the training file once per epoch and cannot split it: give valid_path "
                             f"and test_path in {job.config or 'the job'} [data], or prepare a cache with a random split "
                             f"(hetero data prepare) and train with --prepared")
        encoding = fit_stream(path, job.schema, reader)
        stream = StreamConfig(shuffle_window=d.shuffle_window)
        batches = BatchConfig(batch_size=job.training.batch_size, shuffle=True, seed=job.training.seed, rank=dp.rank,
                              world_size=dp.size)
        train = StreamBatches(path, encoding, reader, batches, stream, dp.host_group())
        return JobData(train, StreamEval(split.valid_path, encoding, split.reader_of("valid", reader), stream),
                       StreamEval(split.test_path, encoding, split.reader_of("test", reader), stream),
                       encoding.specs(), len(job.schema.dense), encoding, reader, train.bad)
    bad = BadRowCount()
    train, valid, test, encoding = read_dataset(path, job.schema, reader, d.split, job.training.seed, bad)
    n = len(train) + len(valid) + len(test)
    if not (len(train) and len(valid) and len(test)):
        raise ValueError(f"{path} has {n} samples: its train/validation/test split leaves a part empty; use a larger "
                         f"file")
    _check_two_classes(train, f"{path} (its training split)", encoding)
    return JobData(train, valid, test, encoding.specs(), train.num_dense, encoding, reader, bad)


def _check_two_classes(train: Rows, where: str, encoding: Encoding) -> None:
    """Refuse a training split of one class (nothing to learn; a label rule that matches nothing)."""
    positives, n = int(train.label.sum()), len(train)
    if positives in (0, n):
        label = encoding.schema.label
        rule = f"threshold {label.threshold}" if label.threshold is not None else f"positive values {list(label.positive)}"
        raise ValueError(f"{where}: all {n} training rows are {'negative' if positives == 0 else 'positive'} by the "
                         f"label column {label.column!r} ({rule}): check the label's rule in the schema (positive = [...], "
                         f"negative = [...], threshold)")


@dataclasses.dataclass(kw_only=True)
class PrepareCommand:
    """hetero data prepare: a job file's data encoded once into a columnar cache of memory-mapped
    arrays (hetero.data.prepare), which hetero train --prepared DIR reads."""

    config: Path
    """the job file: its [data] and [schema]"""
    out: Path
    """the cache directory to write (must not exist)"""
    data_path: Path | None = None
    """the data, if [data] names none"""
    data_dir: Path | None = None
    """the directory the job file's relative paths are in"""
    cache_dir: Path | None = None
    """download cache (default $HETERO_CACHE or ~/.cache/hetero)"""
    seed: int = 0
    """seeds a random split"""


def prepare_cache(command: PrepareCommand) -> Path:
    """``hetero data prepare``: the job file's data encoded into ``command.out``."""
    job = read_job_file(command.config)
    if job.schema is None:
        raise ValueError(f"{command.config} has no [schema]: prepare encodes a schema's columns")
    data = dataclasses.replace(job.data, path=command.data_path or job.data.path, dir=command.data_dir or job.data.dir,
                               cache_dir=command.cache_dir or job.data.cache_dir)
    job = locate(dataclasses.replace(job, data=data))
    return prepare(job_path(job), job.schema, command.out, job.data.reader, job.data.split, command.seed)
