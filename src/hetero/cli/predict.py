"""``hetero predict``: a run's checkpoint scoring a file (:func:`hetero.predict.predict`), each
rank its shard under torchrun."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hetero import parallel
from hetero.cli.errors import report_error
from hetero.config.manager import locate
from hetero.config.toml import read_job_file
from hetero.predict import predict


@dataclasses.dataclass(kw_only=True)
class PredictCommand:
    """hetero predict: a run's checkpoint scoring a file (each rank its share under torchrun)."""

    checkpoint: Path
    """An integrated checkpoint of a `hetero train --config` run (best.pt, checkpoint.pt, a merged file): it holds
    the model, encoding and reader settings the run used."""
    data: Path
    """The file to score (with the schema's columns)."""
    out: Path
    """scores.parquet or scores.csv (score, and label when the file has the label column: AUC and log loss are
    then printed)."""
    config: Path | None = None
    """A job file to locate the run's side tables (joins); its [data] reader settings must be the run's (by
    default the file is read as the run read its data)."""
    id_column: str | None = None
    """A column of --data copied into the scores beside each row's score (a key)."""
    data_dir: Path | None = None
    """The directory the job file's relative paths are in."""
    cache_dir: Path | None = None
    """Download cache (default $HETERO_CACHE or ~/.cache/hetero)."""
    batch_size: int = 8192
    """Rows scored at a time."""
    cache_mb: float | None = None
    """Row cache (MiB) per table group of a run that kept tables on the SSD tier (default: the tier's)."""


def _cache_bytes(mb: float) -> int:
    """``--cache-mb`` in bytes.

    Raises:
        ValueError: not a positive finite number of MiB.
    """
    if not (0 < mb < float("inf")):
        raise ValueError(f"--cache-mb {mb}: give a positive number of MiB")
    return int(mb * (1 << 20))


def run_predict(command: PredictCommand) -> int:
    """Run ``hetero predict``; print its result as one JSON line (rank 0); the exit status."""
    failed = True
    try:
        reader = None  # the run's own reader settings, from its checkpoint
        if command.config is not None:
            job = read_job_file(command.config)
            data = dataclasses.replace(job.data, dir=command.data_dir or job.data.dir,
                                       cache_dir=command.cache_dir or job.data.cache_dir)
            reader = locate(dataclasses.replace(job, data=data)).data.reader
        parallel.init(parallel.DistConfig(backend="gloo"))  # scoring runs on the host: gloo for the barrier
        got = predict(command.checkpoint, command.data, command.out, reader, command.batch_size,
                      parallel.global_rank(), parallel.world_size(), command.id_column,
                      None if command.cache_mb is None else _cache_bytes(command.cache_mb))
        failed = False
    except Exception as e:  # noqa: BLE001 - reported, then the exit code says it failed
        report_error(e)
        return 1
    finally:
        parallel.shutdown(clean=not failed)
    if got is not None:
        out, metrics = got
        print(json.dumps({"scores": str(out), "checkpoint": str(command.checkpoint), "data": str(command.data),
                          **metrics}, allow_nan=False))
    return 0
