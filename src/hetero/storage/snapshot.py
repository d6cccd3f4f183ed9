"""Checkpoints of a :class:`~hetero.storage.records.RowFile` that share its files: a snapshot is a
directory of hard links to the store's sealed segment files, the row index, and a manifest.

Writing one (:func:`write`) seals the store (its segments ``fsync``'ed and closed to appends: no
file it holds is written again, the cleaner only deletes and creates files), links every segment
holding a live record into the snapshot's directory, and writes the index (8 bytes a row) and
then the manifest (``manifest.json``: the record layout, the sizes, each file's CRC-32 kept as it
was written, and the caller's ``extra``), each ``fsync``'ed. A snapshot is therefore incremental:
a segment unchanged since the last snapshot is one more link to the same file, and only the
segments written since and the index are new bytes. It is consistent: the store does not change
while it is written (the training thread writes it between steps). A directory without its
manifest is an unfinished snapshot; the caller names snapshots so that a crash leaves the last
complete one in place (:mod:`hetero.train.tier`). Where links are impossible (another file
system), the files are copied.

Reading one (:func:`verify`, :func:`restore`) checks every file's size and CRC-32 against the
manifest first, naming the damaged file, and changes nothing before; a restored store links the
snapshot's files back (the cleaner deletes its own links, never the snapshot's) and starts a new
segment for its appends.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from zlib_ng import zlib_ng

from hetero.checkpoint.io import CheckpointError, fsync_path
from hetero.storage.layout import Field, RecordLayout
from hetero.storage.records import RowFile

MANIFEST, INDEX = "manifest.json", "index.bin"
FORMAT = 1
_CHUNK = 16 << 20  # bytes per read while checking a file's CRC-32


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src``, or a copy where the file system cannot link."""
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copyfile(src, dst)
        fsync_path(dst)


def _layout_to_json(layout: RecordLayout) -> list:
    return [[f.name, str(f.dtype).removeprefix("torch."), f.width, f.scalar] for f in layout.fields]


def _layout_of(manifest: dict) -> RecordLayout:
    return RecordLayout(tuple(Field(n, getattr(torch, d), w, s) for n, d, w, s in manifest["fields"]))


def write(file: RowFile, dest: str | os.PathLike, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Snapshot ``file`` (whose cache the caller has flushed) into the new directory ``dest``;
    returns the manifest.

    Raises:
        OSError: a failed write (``ENOSPC``, ``EFBIG``, ``EIO``), naming the file and the fix; the
            store and every earlier snapshot are unchanged, ``dest`` is left unfinished (no manifest).
    """
    dest = Path(dest)
    file.seal()
    dest.mkdir(parents=True)
    segments = {}
    for s in np.flatnonzero(file.live > 0).tolist():
        name = file.segment_path(s).name
        _link(file.segment_path(s), dest / name)
        segments[name] = [int(file.sizes[s]), file.crcs[s]]
    index = file.positions.view(np.uint8)
    manifest = {"format": FORMAT, "fields": _layout_to_json(file.layout), "rows": file.rows, "segment": file.segment,
                "slot_bytes": file.slot_bytes, "segments": segments,
                "index": [INDEX, index.nbytes, zlib_ng.crc32(index)], "extra": extra or {}}
    try:
        with open(dest / INDEX, "wb") as f:
            f.write(memoryview(index))
            f.flush()
            os.fsync(f.fileno())
        with open(dest / (MANIFEST + ".tmp"), "w") as f:  # (last: a directory without it is unfinished)
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(dest / (MANIFEST + ".tmp"), dest / MANIFEST)
        fsync_path(dest)
    except OSError as e:
        raise OSError(e.errno, f"writing the checkpoint of {file.path.name} in {dest} failed: {e.strerror}; free "
                               f"space there (the last checkpoint is intact), then resume from it") from None
    return manifest


def read_manifest(snapshot: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a snapshot directory.

    Raises:
        CheckpointError: no manifest (an unfinished or missing snapshot), or an unreadable one.
    """
    path = Path(snapshot) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the SSD tier's checkpoint {snapshot} is unfinished or gone; "
                              f"use a complete checkpoint (its tier snapshots are in its run directory)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}): the checkpoint is damaged") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this hetero reads {FORMAT}")
    return manifest


def _crc(path: Path) -> tuple[int, int]:
    size, crc = 0, 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            size += len(chunk)
            crc = zlib_ng.crc32(chunk, crc)
    return size, crc


def verify(snapshot: str | os.PathLike) -> dict[str, Any]:
    """Check every file of a snapshot against its manifest (sizes and CRC-32s); returns the manifest.

    Raises:
        CheckpointError: a missing, truncated or changed file, naming it.
    """
    snapshot = Path(snapshot)
    manifest = read_manifest(snapshot)
    name, nbytes, crc = manifest["index"]
    for file, (want_size, want_crc) in [*manifest["segments"].items(), (name, (nbytes, crc))]:
        try:
            got = _crc(snapshot / file)
        except FileNotFoundError:
            raise CheckpointError(f"{snapshot / file} is missing from the SSD tier's checkpoint: the checkpoint is "
                                  f"damaged; resume from another one") from None
        if got != (want_size, want_crc):
            raise CheckpointError(f"{snapshot / file} does not match its checksum (size {got[0]} of {want_size}, "
                                  f"CRC-32 {got[1]:08x} of {want_crc:08x}): the file is damaged; resume from another "
                                  f"checkpoint")
    return manifest


def layout_of(manifest: dict[str, Any]) -> RecordLayout:
    """The record layout a snapshot holds."""
    return _layout_of(manifest)


def read_fields(snapshot: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every field of every row of a snapshot (verified first), in row order: field name ->
    ``(rows, width)`` or ``(rows,)`` tensor. For tables that fit in memory (tests, exports).

    Raises:
        CheckpointError: as :func:`verify`.
    """
    snapshot = Path(snapshot)
    manifest = verify(snapshot)
    layout, segment = _layout_of(manifest), manifest["segment"]
    positions = np.fromfile(snapshot / manifest["index"][0], np.int64)
    records = np.empty((positions.shape[0], layout.nbytes), np.uint8)
    for name in manifest["segments"]:
        s = int(name.split(".")[0])
        slots = np.fromfile(snapshot / name, np.uint8).reshape(-1, manifest["slot_bytes"])
        mine = np.flatnonzero(positions // segment == s)
        records[mine] = slots[positions[mine] % segment, RowFile.HEADER :]
    out = {}
    for f in layout.fields:
        at = layout.offset(f.name)
        raw = torch.from_numpy(np.ascontiguousarray(records[:, at : at + f.nbytes]))
        out[f.name] = raw.view(torch.int16 if f.dtype == torch.bfloat16 else f.dtype).view(f.dtype).reshape(
            f.shape(positions.shape[0]))
    return out


def restore(snapshot: str | os.PathLike, path: str | os.PathLike, threads: int = 8,
            manifest: dict[str, Any] | None = None, mapped_bytes: int = 1 << 30) -> RowFile:
    """A store in the new scratch directory ``path`` holding a snapshot's records (its files
    linked back); ``manifest``: the snapshot's, already :func:`verify`'d (else it is verified here).

    Raises:
        CheckpointError: as :func:`verify`.
    """
    snapshot = Path(snapshot)
    manifest = manifest or verify(snapshot)
    file = RowFile(path, _layout_of(manifest), manifest["rows"], threads, segment=manifest["segment"], empty=True,
                   mapped_bytes=mapped_bytes)
    for name, (size, crc) in sorted(manifest["segments"].items()):
        s = int(name.split(".")[0])
        _link(snapshot / name, file.segment_path(s))
        file.attach(s, size, crc)  # (sealed: only read, then deleted by the cleaner)
    file.index(np.fromfile(snapshot / manifest["index"][0], np.int64))
    file._free = [s for s in range(file.live.shape[0]) if file.fds[s] < 0]
    return file
