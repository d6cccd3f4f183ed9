"""The config manager: one :class:`~hetero.config.job.JobConfig` from the defaults < a job file
(``--config``) < the command line, validated once.

The command line is parsed by ``tyro`` from the dataclasses themselves (as torchtitan's
``ConfigManager`` does): every key is ``--section.key value`` (``--training.batch_size 512``;
``-`` and ``_`` alike) and its old flag is an alias (``--batch-size 512``). The job file's values
are the defaults the command line overrides. The reader and split keys of ``[data]`` (a flat
table in a job file, two dataclasses in the job) are read from the command line as the job
file's are (``--data.valid_path dev.csv``, :func:`hetero.config.toml.data_keys`), over its
``[data]``. The only other rewriting of the command line is the old bare ``--resume``
(``--resume yes``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import tyro

from hetero.config.job import SECTIONS, JobConfig, TableSharding, TableStorage, keys
from hetero.config.toml import data_keys, read_job_file
from hetero.data.fetch import fetch_public
from hetero.models.build import ModelKind
from hetero.train.config import CheckpointFormat


def load_job(argv: Sequence[str], prog: str = "hetero train") -> JobConfig:
    """The job of the command line ``argv`` (the command's arguments, without ``hetero train``).

    Raises:
        FileNotFoundError, ValueError: the job file is missing or bad, or a value is out of its
            range (naming the key, its flag and the range).
        SystemExit: a flag that does not exist or does not parse (tyro prints which, and the
            closest flag), or ``--help``.
    """
    argv, data = data_keys(_bare_resume(list(argv)))  # (--data.valid_path, --data.header, ...: [data]'s own keys)
    path = _config_path(argv)
    base = read_job_file(path, data)
    job = tyro.cli(JobConfig, args=argv, default=base, prog=prog, use_underscores=True,
                   config=(tyro.conf.EnumChoicesFromValues,))
    validate(job)
    return job


def _bare_resume(argv: list[str]) -> list[str]:
    """``--resume`` without a value (the old flag's form) as ``--resume yes``."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("yes")
    return out


def _config_path(argv: list[str]) -> Path | None:
    """The ``--config`` value, read before the rest: the job file is the command line's defaults."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1])
    return None


def validate(job: JobConfig) -> None:
    """Check every key against its bounds (:class:`~hetero.config.job.Bounds`) and the keys that
    only make sense together.

    Raises:
        ValueError: naming the key, its old flag, the value and the valid range.
    """
    for section_name, cls in (("data", type(job.data)), *SECTIONS.items()):
        section = getattr(job, section_name)
        for name, info in keys(cls).items():
            value, k = getattr(section, name), info.bounds
            if k is None:
                continue
            where = f"{section_name}.{name}" + (f" ({info.flag})" if info.flag else "")
            for v in value if isinstance(value, tuple) else (value,):
                if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                if isinstance(v, float) and math.isinf(v):
                    raise ValueError(f"{where} = {_shown(value)}: give a finite number")
                if k.low is not None and (v < k.low or (v == k.low and not k.inclusive)) or v != v:
                    bound = f">= {k.low}" if k.inclusive else f"> {k.low}"
                    what = "values" if isinstance(value, tuple) else "a value"
                    raise ValueError(f"{where} = {_shown(value)}: give {what} {bound}"
                                     + (f" and < {k.below}" if k.below is not None else ""))
                if k.below is not None and v >= k.below:
                    raise ValueError(f"{where} = {_shown(value)}: give a value in [{k.low}, {k.below})")
    _check_together(job)
    if job.training.patience and not job.checkpoint.keep_best:
        job.checkpoint = dataclasses.replace(job.checkpoint, keep_best=True)  # patience implies keeping the best


# (key, its flag, whether the job sets it) of what the main job runs beside each of these keys
def _set(job: JobConfig) -> dict[str, tuple[str, bool]]:
    p, t = job.parallelism, job.training
    return {"parallelism.tp": ("--tp", p.tp > 1), "parallelism.pp": ("--pp", p.pp > 1),
            "parallelism.zero": ("--zero", p.zero > 0),
            "parallelism.table_sharding": ("--table-sharding row", p.table_sharding is TableSharding.ROW),
            "parameter_server.servers": ("--ps-servers", job.parameter_server.servers > 0),
            "training.prefetch": ("--prefetch", t.prefetch), "data.stream": ("--stream", job.data.stream),
            "checkpoint.format": ("--checkpoint-format sharded", job.checkpoint.format is CheckpointFormat.SHARDED),
            "tables.storage": (f"--table-storage {job.tables.storage.value}", job.tables.storage is not TableStorage.MEMORY)}


# a key -> the keys the main job does not run beside it, and why
_APART = {
    "parallelism.tp": (("parameter_server.servers", "parallelism.table_sharding", "training.prefetch",
                        "parallelism.pp"),
                       "operator parallelism runs with replicated host tables and no other dimension"),
    "parallelism.pp": (("parameter_server.servers", "parallelism.table_sharding", "training.prefetch",
                        "parallelism.zero", "checkpoint.format"),
                       "the pipeline runs alone (replicated tables, integrated checkpoints)"),
    "parameter_server.servers": (("parallelism.zero", "parallelism.table_sharding", "training.prefetch"),
                                 "a parameter server's workers train data-parallel with replicated dense parts"),
    "parallelism.table_sharding": (("training.prefetch",), "the prefetcher reads replicated tables only"),
    "tables.storage": (("parallelism.pp", "parallelism.tp", "checkpoint.format"),
                       "the SSD tier holds replicated, row-sharded or parameter-server tables beside data parallelism, "
                       "with integrated checkpoints (sharded ones on parameter servers) (for now)"),
}


def _check_together(job: JobConfig) -> None:
    """The keys the main job runs only apart, its model's limits and a plan's."""
    on = _set(job)
    for key, (others, why) in _APART.items():
        both = [f"{o} ({on[o][0]})" for o in others if on[key][1] and on[o][1]]
        if both:
            raise ValueError(f"{key} ({on[key][0]}) with {', '.join(both)}: {why}; drop one")
    p = job.parallelism
    if p.micro_batches is not None and p.pp == 1:
        raise ValueError("parallelism.micro_batches (--micro-batches) cuts a pipeline's batch: set parallelism.pp > 1, "
                         "or drop it")
    micro = p.micro_batches or p.pp
    if job.training.batch_size % micro:
        raise ValueError(f"parallelism.micro_batches = {micro} does not divide training.batch_size = "
                         f"{job.training.batch_size} (--batch-size): choose a batch size that is a multiple of it")
    if job.model.name is ModelKind.DLRM:
        split = [f"{k} ({on[k][0]})" for k in ("parallelism.pp", "parallelism.tp", "parallelism.zero") if on[k][1]]
        if split:
            raise ValueError(f"{split[0]} splits Wide & Deep's MLP; model.name = dlrm (--model dlrm) trains "
                             f"data-parallel: drop it")
    if job.planner.plan is not None:
        given = [f"{k} ({on[k][0]})" for k in ("data.stream", "parallelism.pp", "parallelism.tp",
                                                "parameter_server.servers") if on[k][1]]
        if given:
            raise ValueError(f"planner.plan (--plan) plans a data-parallel job on in-memory or prepared data: drop "
                             f"{', '.join(given)} (to stream, prepare a cache: hetero data prepare)")


def _shown(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def locate(job: JobConfig) -> JobConfig:
    """``job`` with its data's relative paths made absolute: under ``data.dir`` if given, else
    under the fetched data set's directory (downloaded into ``data.cache_dir`` if needed), else
    under the current directory - so the ``config.toml`` a run writes reads the same files from
    anywhere.

    Raises:
        ValueError: ``data.fetch`` names no public data set (naming the valid ones).
        RuntimeError: the download failed or did not match its pinned SHA-256.
    """
    d = job.data
    base = d.dir if d.dir is not None else fetch_public(d.fetch, d.cache_dir) if d.fetch else Path.cwd()
    base = base.absolute()

    def under(p):  # noqa: ANN001, ANN202 - a Path, a tuple of them, or None
        if isinstance(p, tuple):
            return tuple(under(x) for x in p)
        return p if p is None or p.is_absolute() else base / p

    joins = tuple(dataclasses.replace(j, path=under(j.path)) for j in d.reader.joins)
    split = dataclasses.replace(d.split, valid_path=under(d.split.valid_path), test_path=under(d.split.test_path))
    prepared = d.prepared if d.prepared is None or d.prepared.is_absolute() else Path.cwd() / d.prepared
    data = dataclasses.replace(d, path=under(d.path), reader=dataclasses.replace(d.reader, joins=joins), split=split,
                               prepared=prepared, dir=None)
    return dataclasses.replace(job, data=data)
