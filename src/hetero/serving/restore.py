"""A trained run's model, rebuilt from an integrated checkpoint and its run record
(:mod:`hetero.record`): what ``hetero predict`` scores with and ``hetero export`` writes out."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hetero.checkpoint import CheckpointError, check_model_compatible
from hetero.checkpoint.io import remove_left_by_dead
from hetero.embedding import host_tables, move_tables_to_ssd
from hetero.models.build import ModelKind, build_model, model_config
from hetero.record import RECORD_KEY, ModelRecord, RunRecord
from hetero.storage import SsdConfig
from hetero.train.tier import TierCheckpoint


def run_record(checkpoint: Path, state: dict[str, Any]) -> RunRecord:
    """The run record a loaded checkpoint holds.

    Raises:
        CheckpointError: none there (a checkpoint of a built-in data set's run, or written
            before hetero kept one), or no encoding in it.
    """
    if RECORD_KEY not in state:
        raise CheckpointError(f"checkpoint {checkpoint} holds no run record (a run on a built-in data set, or written "
                              f"by an older hetero): use the checkpoint of a `hetero train --config` run")
    record = RunRecord.from_state(state[RECORD_KEY], checkpoint)
    if record.encoding is None:
        raise CheckpointError(f"checkpoint {checkpoint} is of a run without a schema: only runs trained from a job "
                              f"file's [schema] are scored or exported")
    return record


SCRATCH_PREFIX = ".hetero-scratch-"


@contextlib.contextmanager
def tier_scratch(checkpoint: Path, state: dict[str, Any], near: Path | None = None) -> Iterator[Path | None]:
    """A scratch directory for :func:`restore_model` to link a checkpoint's SSD tier snapshots
    into, removed on exit; ``None`` (nothing made) when the checkpoint keeps no tables on the tier.

    Hard links need the checkpoint's file system, so it goes under the system's temporary
    directory if that is on it, else beside ``near`` (the output) if that is, else beside the
    checkpoint. It is named ``.hetero-scratch-<pid>-*``: one a killed process left is removed by
    the next that picks the same place (its process is gone).

    Raises:
        OSError: no writable place on the checkpoint's file system, naming the directories tried.
    """
    if not state.get("tier"):
        yield None
        return
    device = os.stat(checkpoint.parent).st_dev
    tried = [Path(tempfile.gettempdir()), *([near] if near is not None else []), checkpoint.parent]
    where = next((d for d in tried if d.is_dir() and os.stat(d).st_dev == device and os.access(d, os.W_OK)), None)
    if where is None:
        raise OSError(f"checkpoint {checkpoint} keeps tables on the SSD tier, read through hard links on its own file "
                      f"system, and none of {[str(d) for d in tried]} is writable there: give an --out on it")
    remove_left_by_dead(where, SCRATCH_PREFIX)
    with tempfile.TemporaryDirectory(dir=where, prefix=f"{SCRATCH_PREFIX}{os.getpid()}-") as scratch:
        yield Path(scratch)


def restore_model(checkpoint: Path, state: dict[str, Any], record: RunRecord, specs: tuple,
                  scratch: Path | None, cache_bytes: int | None = None) -> torch.nn.Module:
    """The checkpoint's model in evaluation mode, its state loaded. Tables the run kept on the SSD
    tier are read from its snapshots, linked into ``scratch`` (a directory on the checkpoint's
    file system, :func:`tier_scratch`; ``None``: such a checkpoint is refused), under a row cache of
    ``cache_bytes`` per table group (``None``: the tier's default).

    Raises:
        CheckpointError: a model that does not fit the checkpoint, or tables on the SSD tier
            without ``scratch``.
    """
    entry = state.get("tier")
    if entry and scratch is None:
        raise CheckpointError(f"checkpoint {checkpoint} keeps tables on the SSD tier: they cannot be exported yet; "
                              f"train them in memory ([tables] storage = \"memory\") to export")
    sizes = {} if cache_bytes is None else {"cache_bytes": cache_bytes}
    ssd = SsdConfig(Path(scratch), **sizes) if entry else None
    model = _model(specs, record.model, ssd)
    saved = [name for g in (entry or {"groups": {}})["groups"].values() for name, _ in g["tables"]]
    if entry and sorted(saved) != sorted(host_tables(model)):  # some tables on the tier (a planned run's)
        model = _model(specs, record.model, None)
        move_tables_to_ssd(model, saved, ssd, write=False)
    tier = TierCheckpoint(model, checkpoint.parent)
    parts = tier.check(entry, checkpoint)
    check_model_compatible(model.state_dict(), state["model"], checkpoint)
    tier.restore(parts)
    model.load_state_dict(state["model"])
    return model.eval()


def _model(specs: tuple, record: ModelRecord, ssd: SsdConfig | None) -> torch.nn.Module:
    try:
        kind = ModelKind(record.kind)
    except ValueError:
        raise ValueError(f"the run record's model {record.kind!r} cannot be rebuilt here (known: "
                         f"{[k.value for k in ModelKind]})") from None
    return build_model(kind, model_config(kind, record.config), specs, record.num_dense, ssd)
