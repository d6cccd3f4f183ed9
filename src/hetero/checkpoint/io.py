"""Atomic checkpoint files.

A checkpoint is written to a temporary file in the same directory, flushed and fsync'ed, then
renamed over the old one (``os.replace`` is atomic on POSIX), and the directory is fsync'ed. A
crash at any point leaves either the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations


import contextlib
import errno
import glob
import os
import shutil
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch


class CheckpointError(ValueError):
    """A checkpoint cannot be read, or does not fit the model it is loaded into."""


def save_checkpoint(state: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``state`` (tensors, containers, numbers, strings) to ``path`` atomically.

    Raises:
        OSError: the write failed (a full disk, a file size limit, an I/O error), naming the file
            and the cause (``ENOSPC``, ``EFBIG``, ``EIO``); the file at ``path`` is as before.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with naming_write(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as raw:
                f = _Recording(raw)
                try:
                    torch.save(dict(state), f)
                except RuntimeError as e:  # torch's writer hides the OSError of the file's write
                    raise (f.error or e) from e
                raw.flush()
                os.fsync(raw.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)  # make the rename itself durable
    return path


class _Recording:
    """A binary file for ``torch.save`` that keeps the ``OSError`` a write raised (torch's zip
    writer turns it into ``RuntimeError: [enforce fail ...] unexpected pos``)."""

    def __init__(self, f) -> None:  # noqa: ANN001 - a binary file
        self.f, self.error = f, None

    def write(self, data) -> int:  # noqa: ANN001 - bytes-like
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


@contextlib.contextmanager
def naming_write(path: Path) -> Iterator[None]:
    """An ``OSError`` raised inside (or pyarrow's error wrapping one) re-raised as one ``OSError``
    naming ``path`` and the cause: ``cannot write PATH: ENOSPC No space left on device``."""
    try:
        yield
    except OSError as e:
        code = e.errno
        cause = errno.errorcode.get(code, "") if code else ""
        raise OSError(code, f"cannot write {path}: {cause + ' ' if cause else ''}{e.strerror or e}") from e


def fsync_path(path: str | Path) -> None:
    """``fsync`` a file or a directory by its path (a directory: its entries - renames, new and
    deleted files - become durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (tensors only, no pickled code).

    Raises:
        CheckpointError: the file is missing, truncated, corrupted (a record failing its CRC-32)
            or not a checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    verify_zip(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for torn or foreign files
        raise CheckpointError(f"checkpoint {path} is unreadable (truncated or not a hetero checkpoint): {e}") from e


def check_model_compatible(model_state: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Check that ``saved`` has exactly the parameters and shapes of ``model_state``.

    Raises:
        CheckpointError: naming the first mismatching parameter and both shapes, or the
            parameters only one side has.
    """
    for name, tensor in model_state.items():
        if name in saved and saved[name].shape != tensor.shape:
            raise CheckpointError(
                f"checkpoint {path} was saved from another model config: parameter {name!r} has shape "
                f"{tuple(saved[name].shape)} in the checkpoint and {tuple(tensor.shape)} in this model"
            )
    missing = sorted(set(model_state) - set(saved))
    extra = sorted(set(saved) - set(model_state))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint {path} was saved from another model config: parameters missing from the checkpoint "
            f"{missing[:5]}, parameters this model lacks {extra[:5]}"
        )


def verify_zip(path: Path) -> None:
    """Check the CRC-32 of every record of a ``torch.save`` archive (``torch.load`` does not: 4 KiB
    of 0xFF inside a tensor load without error and surface as NaN steps later). One extra read.

    Raises:
        CheckpointError: a record whose bytes changed since they were written, naming it.
    """
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable (truncated or not a hetero checkpoint): {e}") from e
    if bad is not None:
        raise CheckpointError(f"checkpoint {path} is corrupted: record {bad} fails its CRC-32 check; resume from "
                              f"another checkpoint")


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``text`` to ``path`` atomically: a temporary file in the same directory, flushed to disk,
    then renamed over ``path`` (a reader sees the old file or the new one, never a part)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def remove_left_by_dead(directory: Path, prefix: str) -> None:
    """Remove the entries of ``directory`` named ``<prefix><pid>...`` whose process is gone: the
    scratch and temporary outputs a killed (``kill -9``) predict or export left, at the next start.
    An entry of a live process, or of another user's, stays."""
    for old in Path(directory).glob(f"{glob.escape(prefix)}*"):
        pid = old.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
        except PermissionError:  # another user's live process
            pass
