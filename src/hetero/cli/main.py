"""``hetero``'s command line: one command per main task.

``hetero train``   the main job (:mod:`hetero.cli.train`) from a :class:`~hetero.config.job.JobConfig`
``hetero plan``    the job's plan (:func:`hetero.plan`) for a world size, written to a file
``hetero predict`` a run's checkpoint scoring a file (:mod:`hetero.cli.predict`)
``hetero export``  a run's checkpoint for serving, or a delta since an older one (:mod:`hetero.serving`)
``hetero data prepare``      a job's data encoded once into a columnar cache
``hetero checkpoint merge``  a sharded checkpoint into one integrated file

Each command's arguments are a dataclass parsed by ``tyro``; ``train`` and ``plan`` take the job
configuration (:func:`hetero.config.manager.load_job`). The last line printed to stdout is the
command's result as one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import tyro

from hetero_cli import USAGE
from hetero.cli.data import PrepareCommand, prepare_cache
from hetero.cli.errors import report_error
from hetero.cli.plan import plan_job
from hetero.cli.predict import PredictCommand, run_predict
from hetero.cli.train import run_train
from hetero.config.manager import load_job
from hetero.placement.memory import retain_freed_memory
from hetero.checkpoint import save_checkpoint
from hetero.checkpoint.sharded import read_full, resolve
from hetero.serving import export
from hetero.train.checkpointing import to_integrated




@dataclasses.dataclass(kw_only=True)
class MergeCommand:
    """hetero checkpoint merge: a sharded checkpoint into one integrated file (for inference)."""

    source: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="SOURCE")]
    """The checkpoint.dcp directory."""
    output: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="OUTPUT")]
    """The integrated checkpoint file to write (atomically)."""


@dataclasses.dataclass(kw_only=True)
class ExportCommand:
    """hetero export: a run's checkpoint for serving - the dense part a torch.export program, the tables
    Parquet files of keys and rows - or, with --since, the delta from an older checkpoint (docs/dynamic-tables.md)."""

    checkpoint: Path
    """An integrated checkpoint of a `hetero train --config` run."""
    out: Path
    """The export directory to write (a new one; written whole, then renamed)."""
    since: Path | None = None
    """An older checkpoint of the same run: write only the rows changed since, and the keys evicted since."""


def merge(source: Path, output: Path) -> Path:
    """Write the integrated checkpoint of the sharded checkpoint ``source`` to ``output``.

    Raises:
        CheckpointError: ``source`` is missing, incomplete (a shard missing or truncated) or unreadable.
    """

    return save_checkpoint(to_integrated(read_full(source), resolve(source)), output)


def _parse(cls: type, argv: Sequence[str], prog: str) -> Any:  # noqa: ANN401 - an instance of cls
    return tyro.cli(cls, args=list(argv), prog=prog, use_underscores=True)


def _run(what: Callable[[], Any], result: Callable[[Any], dict]) -> int:  # noqa: ANN401
    """``what()``, its result printed as one JSON line; an error reported (see :func:`report_error`)."""
    try:
        out = what()
    except Exception as e:  # noqa: BLE001 - reported, then the exit code says it failed
        report_error(e)
        return 1
    print(json.dumps(result(out)))
    return 0


def main(argv: Sequence[str] | None = None, on_step=None) -> int:  # noqa: ANN001 - a callable of the Trainer
    """Run the command line ``argv`` (default ``sys.argv[1:]``); ``on_step`` (see
    :class:`~hetero.train.trainer.Trainer`) is for embedding callers. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command in ("data", "checkpoint"):
        sub = rest[0] if rest else ""
        if (command, sub) not in (("data", "prepare"), ("checkpoint", "merge")):
            print(USAGE, file=sys.stderr)
            return 2
        command, rest = f"{command} {sub}", rest[1:]
    if command not in ("train", "plan", "predict", "export", "data prepare", "checkpoint merge"):
        print(USAGE, file=sys.stderr if command not in ("-h", "--help") else sys.stdout)
        return 0 if command in ("-h", "--help") else 2
    prog = f"hetero {command}"
    try:
        if command in ("train", "plan"):
            job = load_job(rest, prog)
        else:
            parsed = _parse({"predict": PredictCommand, "export": ExportCommand, "data prepare": PrepareCommand,
                             "checkpoint merge": MergeCommand}[command], rest, prog)
    except (OSError, ValueError) as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    retain_freed_memory()  # (this process is the command's: a step's freed buffers stay mapped for the next)
    if command == "train":
        return run_train(job, on_step)
    if command == "plan":
        return _run(lambda: plan_job(job), lambda out: {"plan": str(out)})
    if command == "predict":
        return run_predict(parsed)
    if command == "export":
        return _run(lambda: export(parsed.checkpoint, parsed.out, parsed.since),
                    lambda manifest: {"export": str(parsed.out), "kind": manifest["kind"],
                                      "rows": sum(t.get("changed", t["rows"]) for t in manifest["tables"].values()),
                                      "tombstones": sum(t.get("tombstones", 0) for t in manifest["tables"].values())})
    if command == "data prepare":
        return _run(lambda: prepare_cache(parsed), lambda out: {
            "prepared": str(out), **json.loads((out / "manifest.json").read_text())["splits"]["train"]})
    return _run(lambda: merge(parsed.source, parsed.output),
                lambda out: {"merged": str(parsed.source), "checkpoint": str(out)})
