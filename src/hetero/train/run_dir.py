"""A run directory: one run's checkpoints, metrics, plots and plan. Checked before a job reads
or writes anything (:func:`check_run_dir`): a directory that holds another run is refused unless
the job resumes it or overwrites it, and one that cannot be written is named first."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hetero.checkpoint.io import write_text_atomic


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
    """Remove a previous run's files from ``run_dir`` (``--overwrite``): only the names its
    :data:`MANIFEST` lists (its checkpoints, report, plots, TensorBoard scalars and SSD tier
    snapshots); a directory no hetero run recorded loses nothing."""
    manifest = run_dir / MANIFEST
    if not manifest.is_file():
        return
    for name in json.loads(manifest.read_text())["files"]:
        for path in (run_dir / name, run_dir / f"{name}.old", run_dir / f"{name}.tmp", run_dir / f".{name}.tmp"):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()




OWNER = ".hetero-owner"  # an SSD store directory's: the run directory whose run made it
MANIFEST = ".hetero-run.json"  # a run directory's: the names its run writes (what --overwrite may remove)


class RunLock:
    """This process's hold on a run directory and its SSD store directory for the run's life
    (``with RunLock(...)``): a ``filelock`` lock per rank in each (released when the process
    ends, ``kill -9`` too), so a second run given the same ``--run-dir`` or ``--ssd-path`` is
    refused in one line before it reads or writes anything else, and a store records its run
    directory (:data:`OWNER`): a store another run made is refused, never deleted. On a refusal,
    or an error before the run wrote anything, the directories this made are removed again if
    they are empty (never a file in them: another rank's may be there).

    Raises:
        ValueError: the directory is held by another running process, or the store is another
            run's (naming both directories and the fix).
    """

    def __init__(self, run_dir: Path, store: Path | None, rank: int) -> None:
        self.run_dir, self.store, self.rank = Path(run_dir), None if store is None else Path(store), rank
        self.locks, self.made = [], []

    def __enter__(self) -> "RunLock":
        try:
            for directory, what in ((self.run_dir, "--run-dir"), (self.store, "--ssd-path")):
                if directory is not None:
                    self._lock(directory, what)
            if self.store is not None:
                self._own(self.store)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _lock(self, directory: Path, what: str) -> None:
        from filelock import FileLock, Timeout

        level = directory
        while not level.exists():
            self.made.append(level)  # (deepest first)
            level = level.parent
        directory.mkdir(parents=True, exist_ok=True)
        lock = FileLock(directory / f".hetero-rank{self.rank}.lock", blocking=False)
        try:
            lock.acquire()
        except Timeout:
            raise ValueError(f"{what} {directory} is in use by another running hetero job (its rank {self.rank} holds "
                             f"{lock.lock_file}): wait for it to end, or give another {what}") from None
        self.locks.append(lock)

    def _own(self, store: Path) -> None:
        owner, ours = store / OWNER, str(self.run_dir.resolve())
        if owner.is_file():
            theirs = owner.read_text().strip()
            if theirs != ours:
                raise ValueError(f"--ssd-path {store} holds the SSD store of the run in {theirs}: give another "
                                 f"--ssd-path, or remove {store} if that run is over (its checkpoints keep their own "
                                 f"snapshots)")
            return
        if any(store.glob("*.rows")):
            raise ValueError(f"--ssd-path {store} holds an SSD store no run recorded as its own: give another "
                             f"--ssd-path, or remove it")
        owner.write_text(ours + "\n")

    def started(self) -> None:
        """The run has begun writing: the directories this made stay."""
        self.made = []

    def __exit__(self, *exc: object) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []
        own = {OWNER, f".hetero-rank{self.rank}.lock"}  # this process's own marks (filelock keeps its files)
        for directory in self.made:  # deepest first; one holding anything else stays
            if directory.is_dir() and {p.name for p in directory.iterdir()} <= own:
                for name in own:
                    (directory / name).unlink(missing_ok=True)
            try:
                directory.rmdir()
            except OSError:
                pass


def record_run_files(run_dir: Path, store: Path | None) -> None:
    """Write the run directory's :data:`MANIFEST` (rank 0; before anything else is written):
    what :func:`remove_run_files` of a later ``--overwrite`` may remove."""
    write_text_atomic(run_dir / MANIFEST, json.dumps({"files": [*RUN_FILES, "tier"],
                                                       "store": None if store is None else str(store)}) + "\n")
