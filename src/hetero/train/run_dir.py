"""A run directory: one run's checkpoints, metrics, plots and plan. Checked before a job reads
or writes anything (:func:`check_run_dir`): a directory that holds another run is refused unless
the job resumes it or overwrites it, and one that cannot be written is named first."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


RUN_FILES = ("checkpoint.pt", "checkpoint.dcp", "best.pt", "best.dcp", "metrics.json", "losses.csv", "curves.png",
             "plan.json", "strategy.json", "config.toml", "tensorboard")  # what a run writes into its directory


def check_run_dir(run_dir: Path, resume: str | None, overwrite: bool) -> None:
    """Check, before anything is read or written, that ``run_dir`` can take this run: a directory
    (or creatable), writable, and not holding another run's checkpoint unless the job resumes it
    or overwrites it.

    Raises:
        ValueError: naming the directory and the fix.
    """
    if resume and overwrite:
        raise ValueError("--resume continues the run in --run-dir and --overwrite replaces it: give one")
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir} is a file: give a directory")
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--run-dir {run_dir} cannot be created: {existing} is a file; give a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--run-dir {run_dir} is not writable ({existing} denies this user): give a directory you can "
                         f"write")
    held = [name for name in RUN_FILES[:4] if (run_dir / name).exists()]
    if held and not resume and not overwrite:
        raise ValueError(f"--run-dir {run_dir} holds another run ({held[0]}): continue it with --resume, replace it with "
                         f"--overwrite, or give another --run-dir")


def remove_run_files(run_dir: Path) -> None:
    """Remove a previous run's files from ``run_dir`` (``--overwrite``; nothing else in it)."""
    for name in RUN_FILES:
        for path in (run_dir / name, run_dir / f"{name}.old", run_dir / f"{name}.tmp", run_dir / f".{name}.tmp"):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


