"""Per-rank sharded checkpoints on ``torch.distributed.checkpoint`` (DCP), written atomically.

A sharded checkpoint is a DCP directory: every rank writes its own shard file
(``__<rank>_0.distcp``) and rank 0 the ``.metadata`` that maps each tensor's chunks to files.
Tensors given as ``DTensor`` are sharded (each rank writes its block); plain tensors and other
values present on every rank are replicated (DCP writes them once). Loading reads whatever
chunks overlap the requested tensors, so a checkpoint saved by N ranks loads into M ranks: the
resharding is DCP's.

Atomicity: the ranks write into ``<name>.tmp``; after all have finished, rank 0 renames the old
checkpoint to ``<name>.old``, the new one into place, and deletes the old one. A crash leaves
either the old checkpoint (under its name or, between the two renames, as ``.old``, which
:func:`resolve` then picks) or the new one - never a torn directory under either name.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hetero.checkpoint.io import CheckpointError, fsync_path
from hetero.checkpoint.integrity import (
    sha256_file,
    write_checksums,
    verify_checksums,
    read_metadata,
    SafeFileSystemReader,
)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet():
    # DCP warns that it "assumes a single process" whenever no_dist is used: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class OwnFiles(Protocol):
    """A rank's files of its own in a sharded checkpoint's directory, beside DCP's and swapped in
    with them (a parameter server's SSD tier snapshots, :mod:`hetero.ps.server`)."""

    def write(self, directory: Path) -> None:
        """Write this rank's files into the new checkpoint ``directory`` (not yet in place)."""

    def check(self, directory: Path) -> Callable[[], None]:
        """Verify this rank's files in the checkpoint ``directory``, changing nothing; return what
        loads them (run after every rank's checks passed and DCP's load).

        Raises:
            CheckpointError: a missing or damaged file, naming it.
        """


def save_sharded(state: Mapping[str, Any], path: str | Path, files: OwnFiles | None = None) -> Path:
    """Write ``state`` as a DCP checkpoint directory ``path`` (every rank calls it), with this
    rank's ``files`` of its own.

    DCP's file writer fsyncs every file; the directory swap is described in the module docstring.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt's leftovers
    _barrier()

    with _single_process_quiet():
        dcp.save(dict(state), checkpoint_id=str(tmp), no_dist=not _distributed())
    if files is not None:
        files.write(tmp)
    _barrier()  # every rank's shard is on disk
    # Each rank hashes the files it wrote; rank 0 writes them all down before the swap, so a
    # checkpoint under its final name always has its checksums.
    mine = {f.name: sha256_file(f) for f in sorted(tmp.glob(f"__{_rank()}_*.distcp"))}
    gathered = [mine]
    if _distributed():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    if _rank() == 0:
        digests = {k: v for d in gathered for k, v in d.items()}
        digests[".metadata"] = sha256_file(tmp / ".metadata")
        write_checksums(tmp, digests)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_path(path.parent)  # the renames themselves are durable
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def _check_files(path: Path, metadata, holds: Callable[[str], bool], part: tuple[int, int] = (0, 1)) -> None:  # noqa: ANN001
    """Every file present and long enough (a stat each); the checksums of ``.metadata`` and of
    the files holding the values whose key ``holds`` accepts (of those, every ``part[1]``-th
    from the ``part[0]``-th: the ranks of a job share the reading)."""

    needed: dict[str, int] = {}
    holders: set[str] = set()
    for index, info in (metadata.storage_data or {}).items():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
        if holds(index.fqn):
            holders.add(name)
    for name, size in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"sharded checkpoint {path}: shard file {name} is missing; the checkpoint is incomplete "
                                  f"(copy every __<rank>_0.distcp file of it, or resume from another checkpoint)")
        if f.stat().st_size < size:
            raise CheckpointError(f"sharded checkpoint {path}: shard file {name} is truncated ({f.stat().st_size} bytes, "
                                  f"{size} expected); resume from another checkpoint")
    files = [".metadata", *sorted(holders)]
    verify_checksums(path, files[part[0] :: part[1]])


def resolve(path: str | Path) -> Path:
    """The checkpoint directory to read: ``path``, or ``path.old`` after a crash between the swap's
    two renames. Raises :class:`CheckpointError` if neither exists."""
    path = Path(path)
    for candidate in (path, path.with_name(path.name + ".old")):
        if (candidate / ".metadata").is_file():
            return candidate
    raise CheckpointError(f"no sharded checkpoint at {path} (no {path / '.metadata'})")


def validate(path: str | Path, part: tuple[int, int] = (0, 1)):  # noqa: ANN201 - DCP's Metadata
    """Check that every shard file the metadata refers to exists, is long enough and has the
    checksum it was written with; the metadata is read without unpickling anything but DCP's
    own classes (:mod:`hetero.checkpoint.integrity`).

    ``part=(i, n)``: verify the checksums of every n-th file from the i-th only (the ranks of a
    job share the reading; the others are checked by the other ranks).

    Returns DCP's ``Metadata``. Raises:
        CheckpointError: naming the missing, truncated or corrupted file and what to do; nothing
            is read into any model before this check passes.
    """

    path = resolve(path)
    metadata = read_metadata(path)
    _check_files(path, metadata, lambda fqn: True, part)
    return metadata


def load_sharded(template: dict[str, Any], path: str | Path, files: OwnFiles | None = None) -> Path:
    """Load a DCP checkpoint into ``template`` in place (every rank calls it), and this rank's
    ``files`` of its own; returns the directory.

    ``template`` has the structure of the saved state: tensors (plain: the full tensor;
    ``DTensor``: this rank's block) are filled in place whatever the saving world size was;
    ``io.BytesIO`` values are replaced by the saved bytes.

    Raises:
        CheckpointError: a missing or truncated shard, or a tensor whose saved global shape
            differs from the template's (naming it, both shapes and the fix); raised before any
            tensor is written.
    """
    import torch.distributed.checkpoint as dcp

    error, load_files = None, None
    try:
        path = _check_template(template, path)
        load_files = files.check(path) if files is not None else None
    except CheckpointError as e:
        error = e
    if _distributed():
        # Ranks load different parts (a parameter server its shard): one rank's error must stop
        # every rank before the collective load, or the others would wait in it forever.
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else str(error))
        first = next((e for e in errors if e is not None), None)
        if first is not None and error is None:
            error = CheckpointError(first)
    if error is not None:
        raise error

    try:
        with _single_process_quiet():
            dcp.load(template, storage_reader=SafeFileSystemReader(str(path)), no_dist=not _distributed())
    except Exception as e:
        raise CheckpointError(f"sharded checkpoint {path} could not be loaded: {e}") from e
    if load_files is not None:
        load_files()
    return path


def read_bytes(path: str | Path, key: str) -> io.BytesIO:
    """The ``io.BytesIO`` value ``key`` of a sharded checkpoint, read by this process alone (no
    collective: any subset of a job's ranks may call it), after the checksums of the metadata
    and of the files that hold it are verified.

    Raises:
        CheckpointError: no such value, or a missing, truncated or corrupted file.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata


    import torch.distributed.checkpoint as dcp

    path = resolve(path)
    metadata = read_metadata(path)
    if not isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata):
        raise CheckpointError(f"sharded checkpoint {path} has no {key!r}: it was not written by this trainer")
    _check_files(path, metadata, lambda fqn: fqn == key)

    state = {key: io.BytesIO()}
    with _single_process_quiet():
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
    return state[key]


def _check_template(template: dict[str, Any], path: str | Path) -> Path:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = resolve(path)
    part = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    saved = validate(path, part).state_dict_metadata
    for key, value in _flatten(template):
        if key not in saved:
            raise CheckpointError(f"sharded checkpoint {path} has no {key!r}: it was saved from another model, optimizer "
                                  f"or parameter-server config; resume with the config it was saved with")
        if isinstance(value, torch.Tensor) and isinstance(saved[key], TensorStorageMetadata):
            if tuple(saved[key].size) != tuple(value.shape):
                raise CheckpointError(
                    f"sharded checkpoint {path}: {key!r} has global shape {tuple(saved[key].size)} in the checkpoint and "
                    f"{tuple(value.shape)} here; a checkpoint reshards across world sizes, not across table or "
                    f"model sizes: resume with the config it was saved with")
    return path


def read_full(path: str | Path) -> dict[str, Any]:
    """Every value of a sharded checkpoint, tensors whole, in one process (no process group).

    For merging and inspection; needs memory for the whole checkpoint.
    """
    # DCP's own dcp_to_torch_save, in memory and with the safe reader: nothing is unpickled
    # beyond the checked metadata (tensors: torch.load(weights_only=True); bytes: raw).
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict


    path = resolve(path)
    validate(path)
    state: dict[str, Any] = {}
    with _single_process_quiet():
        _load_state_dict(state, storage_reader=SafeFileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    return state


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``(key, value)`` leaves of nested dicts, keys joined with ``.`` as DCP's flattening does."""
    out = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out += _flatten(v, key + ".")
        else:
            out.append((key, v))
    return out
