"""The command line's data side: a job's training, validation and test data from its flags and
job file (in memory, streamed, or a prepared cache), and ``hetero data prepare``. Only the CLI
calls this; nothing below it sees ``argparse``."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from hetero import parallel
from hetero.data import BatchConfig, CriteoConfig, load_movielens_100k, read_criteo_tsv
from hetero.data.encode import Encoding
from hetero.data.prepare import load_prepared, prepare
from hetero.data.readers import read_dataset
from hetero.data.stream import StreamBatches, StreamConfig, StreamEval, fit_stream
from hetero.data.tabular import EvalData, Feature, Rows
from hetero.jobfile import JobFile, read_job_file
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


def job_data(args: argparse.Namespace, job: JobFile | None) -> JobData:
    """A prepared cache (``--prepared``); a job file's schema over its (or ``--data-path``'s)
    file, streamed (``--stream``) or read, fitted on the training split; else a built-in data
    set split 80/10/10."""
    if args.prepared is not None:
        train, valid, test, encoding = load_prepared(args.prepared)
        return JobData(train, valid, test, encoding.specs(), train.num_dense, encoding)
    if job is not None and job.schema is not None:
        path = job.source.path or args.data_path
        if path is None:
            raise ValueError(f"{args.config} has a schema but no data: set path in its [data] section, or --data-path")
        if args.stream:
            split = job.source.split
            if split.valid_path is None:
                raise ValueError(f"--stream reads the training file once per epoch and cannot split it: give valid_path "
                                 f"and test_path in {args.config} [data], or prepare a cache with a random split "
                                 f"(hetero data prepare) and train with --prepared")
            encoding = fit_stream(path, job.schema, job.source.reader)
            stream = StreamConfig(shuffle_window=args.shuffle_window)
            batches = BatchConfig(batch_size=args.batch_size, shuffle=True, seed=args.seed, rank=parallel.rank(),
                                  world_size=parallel.world_size())
            return JobData(StreamBatches(path, encoding, job.source.reader, batches, stream, host_group()),
                         StreamEval(split.valid_path, encoding, job.source.reader, stream),
                         StreamEval(split.test_path, encoding, job.source.reader, stream),
                         encoding.specs(), len(job.schema.dense), encoding)
        train, valid, test, encoding = read_dataset(path, job.schema, job.source.reader, job.source.split, args.seed)
        source, n = path, len(train) + len(valid) + len(test)
    else:
        encoding = None
        if args.stream:
            raise ValueError("--stream streams a job file's data: give --config job.toml with [data] and [schema]")
        if args.data == "movielens-100k":
            data = load_movielens_100k(args.data_path, args.cache_dir)
        else:
            if args.data_path is None:
                raise ValueError("--data criteo needs --data-path FILE.tsv (Criteo Kaggle/Terabyte TSV format)")
            data = read_criteo_tsv(args.data_path, CriteoConfig(hash_buckets=args.hash_buckets))
        source, n = args.data_path or args.data, len(data)
        if n >= 10:
            train, valid, test = data.split((0.8, 0.1, 0.1), seed=args.seed)
    if n < 10 or not (len(train) and len(valid) and len(test)):
        raise ValueError(f"{source} has {n} samples: the 80/10/10 train/validation/test split needs at least 10; "
                         f"use a larger file")
    return JobData(train, valid, test, train.specs, train.num_dense, encoding)


def prepare_cache(args: argparse.Namespace, flags: dict[str, bool]) -> Path:
    """``hetero data prepare``: the job file's data encoded into ``args.out`` (``flags``: those of
    ``hetero train``, which the file's [train] section may hold)."""
    job = read_job_file(args.config, flags)
    if job.schema is None:
        raise ValueError(f"{args.config} has no [schema]: prepare encodes a schema's columns")
    path = job.source.path or args.data_path
    if path is None:
        raise ValueError(f"{args.config} names no data: set path in its [data] section, or --data-path")
    return prepare(path, job.schema, args.out, job.source.reader, job.source.split, args.seed)
