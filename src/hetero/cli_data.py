"""The command line's data side: a job's training, validation and test data from its flags and
job file (in memory, streamed, or a prepared cache), and ``hetero data prepare``. Only the CLI
calls this; nothing below it sees ``argparse``."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from hetero import parallel
from hetero.data import BatchConfig
from hetero.data.encode import Encoding
from hetero.data.readers import ReaderConfig
from hetero.data.prepare import load_prepared, prepare, prepared_reader
from hetero.data.split import read_dataset
from hetero.data.stream import StreamBatches, StreamConfig, StreamEval, fit_stream
from hetero.data.tabular import EvalData, Feature, Rows
from hetero.jobfile import DataSource, JobFile, read_job_file
from hetero.parallel.env import host_group


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


def job_source(args: argparse.Namespace, job: JobFile) -> tuple[Path, DataSource]:
    """The job file's main data file (``--data-path`` wins) and its source, paths located
    (``--data-dir``, else a fetched public data set's directory)."""
    source = job.source.located(args.data_dir, args.cache_dir)
    path = args.data_path or source.path
    if path is None:
        raise ValueError(f"{args.config} names no data: set path in its [data] section, or --data-path")
    return path, source


def job_data(args: argparse.Namespace, job: JobFile | None) -> JobData:
    """A prepared cache (``--prepared``), else a job file's schema over its (or ``--data-path``'s)
    file, streamed (``--stream``) or read, fitted on the training split."""
    if args.prepared is not None:
        train, valid, test, encoding = load_prepared(args.prepared)
        _check_two_classes(train, f"{args.prepared} (its training split)", encoding)
        return JobData(train, valid, test, encoding.specs(), train.num_dense, encoding, prepared_reader(args.prepared))
    if job is None or job.schema is None:
        raise ValueError("hetero train needs data: --config job.toml with [data] and [schema] (examples/movielens.toml "
                         "is the demo's), or --prepared DIR")
    path, source = job_source(args, job)
    reader = source.reader
    if args.stream:
        split = source.split
        if split.valid_path is None:
            raise ValueError(f"--stream reads the training file once per epoch and cannot split it: give valid_path "
                             f"and test_path in {args.config} [data], or prepare a cache with a random split "
                             f"(hetero data prepare) and train with --prepared")
        encoding = fit_stream(path, job.schema, reader)
        stream = StreamConfig(shuffle_window=args.shuffle_window)
        batches = BatchConfig(batch_size=args.batch_size, shuffle=True, seed=args.seed, rank=parallel.rank(),
                              world_size=parallel.world_size())
        return JobData(StreamBatches(path, encoding, reader, batches, stream, host_group()),
                       StreamEval(split.valid_path, encoding, reader, stream),
                       StreamEval(split.test_path, encoding, reader, stream),
                       encoding.specs(), len(job.schema.dense), encoding, reader)
    train, valid, test, encoding = read_dataset(path, job.schema, reader, source.split, args.seed)
    n = len(train) + len(valid) + len(test)
    if not (len(train) and len(valid) and len(test)):
        raise ValueError(f"{path} has {n} samples: its train/validation/test split leaves a part empty; use a larger "
                         f"file")
    _check_two_classes(train, f"{path} (its training split)", encoding)
    return JobData(train, valid, test, encoding.specs(), train.num_dense, encoding, reader)


def _check_two_classes(train: Rows, where: str, encoding: Encoding) -> None:
    """Refuse a training split of one class (nothing to learn; a label rule that matches nothing)."""
    positives, n = int(train.label.sum()), len(train)
    if positives in (0, n):
        label = encoding.schema.label
        rule = f"threshold {label.threshold}" if label.threshold is not None else f"positive values {list(label.positive)}"
        raise ValueError(f"{where}: all {n} training rows are {'negative' if positives == 0 else 'positive'} by the "
                         f"label column {label.column!r} ({rule}): check the label's rule in the schema (positive = [...], "
                         f"negative = [...], threshold)")


def prepare_cache(args: argparse.Namespace, flags: dict[str, bool]) -> Path:
    """``hetero data prepare``: the job file's data encoded into ``args.out`` (``flags``: those of
    ``hetero train``, which the file's [train] section may hold)."""
    job = read_job_file(args.config, flags)
    if job.schema is None:
        raise ValueError(f"{args.config} has no [schema]: prepare encodes a schema's columns")
    path, source = job_source(args, job)
    return prepare(path, job.schema, args.out, source.reader, source.split, args.seed)
