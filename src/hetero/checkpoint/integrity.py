"""What a checkpoint reader trusts: no code from files, and no silently corrupted bytes.

* DCP keeps a checkpoint's index in ``.metadata``, a pickle; :class:`SafeFileSystemReader` reads
  it with an unpickler that builds DCP's own metadata classes and nothing else (a crafted file
  that names any other global - ``os.system`` - is refused before anything runs). Tensor and
  byte payloads are then read by DCP with ``torch.load(weights_only=True)`` or as raw bytes.
* Every file of a sharded checkpoint has its SHA-256 in ``.checksums.json`` (written last, before
  the directory is swapped into place; see :mod:`hetero.checkpoint.sharded`), checked on load.
* An integrated checkpoint is a ``torch.save`` zip archive, which stores a CRC-32 per record;
  :func:`hetero.checkpoint.io.load_checkpoint` checks them (``torch.load`` itself does not).

Trust model: a checkpoint from a trusted writer is all that is assumed for the model's own
values; reading one never runs code from it, and a flipped byte is reported, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from hetero.checkpoint.io import CheckpointError

CHECKSUMS = ".checksums.json"

# The globals a DCP ``.metadata`` pickle of torch 2.6 - 2.13 refers to (dataclasses of DCP, an
# enum, torch's own value types); anything else is refused.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle API
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}: a checkpoint's metadata holds DCP's own "
                                     f"classes only")


def read_metadata(path: Path) -> Metadata:
    """DCP's ``Metadata`` of the checkpoint directory ``path``, unpickled with the allow-list.

    Raises:
        CheckpointError: unreadable, or naming a global outside the allow-list (the file is then
            not a DCP checkpoint of this library, or was crafted).
    """
    try:
        with open(path / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - a torn, foreign or crafted file
        raise CheckpointError(f"sharded checkpoint {path}: unreadable .metadata ({e}); resume from another "
                              f"checkpoint") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"sharded checkpoint {path}: .metadata holds a {type(metadata).__name__}, not DCP's "
                              f"Metadata")
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        if Path(name).name != name or name in ("", ".", ".."):  # DCP names its files __<rank>_<n>.distcp
            raise CheckpointError(f"sharded checkpoint {path}: .metadata refers to {name!r}, outside the checkpoint "
                                  f"directory")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` in place of its ``pickle.load``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:  # noqa: ANN002, ANN003 - DCP's signature
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_checksums(path: Path, digests: dict[str, str]) -> None:
    """Write ``.checksums.json`` (file name -> SHA-256) into the checkpoint directory, durably."""
    out = path / CHECKSUMS
    with open(out, "w") as f:
        json.dump(dict(sorted(digests.items())), f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify_checksums(path: Path, files: list[str]) -> None:
    """Check ``files`` of the checkpoint directory ``path`` against its ``.checksums.json``.

    Raises:
        CheckpointError: no checksums file, a file without a checksum, or a mismatch, naming the file.
    """
    try:
        digests = json.loads((path / CHECKSUMS).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"sharded checkpoint {path} has no {CHECKSUMS}: it is incomplete, or was written "
                              f"before hetero stored checksums; resume from another checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"sharded checkpoint {path}: unreadable {CHECKSUMS} ({e})") from e
    for name in files:
        if name not in digests:
            raise CheckpointError(f"sharded checkpoint {path}: {name} has no checksum in {CHECKSUMS}; the checkpoint "
                                  f"was altered after it was written")
        if sha256_file(path / name) != digests[name]:
            raise CheckpointError(f"sharded checkpoint {path}: {name} is corrupted (its SHA-256 differs from the one "
                                  f"written with it); resume from another checkpoint")
