"""The CIFAR-10 binary format (``cifar-10-batches-bin``), read into tensors.

Layout (Krizhevsky, "Learning Multiple Layers of Features from Tiny Images", 2009; the
"binary version" on the dataset's page): each file is a sequence of 3073-byte records - one
label byte (0..9), then a 32 x 32 image as 1024 red, 1024 green and 1024 blue bytes, each plane
row-major. Training data is ``data_batch_1.bin`` .. ``data_batch_5.bin`` (10,000 records each),
test data ``test_batch.bin``. hetero does not download CIFAR-10: pass the directory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

RECORD_BYTES = 1 + 3 * 32 * 32
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def read_cifar10_bin(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One binary file -> ``(images, labels)``: uint8 ``(N, 3, 32, 32)`` and int64 ``(N,)``.

    Raises:
        ValueError: the file size is not a whole number of records, or a label is not 0..9
            (naming the file and the record).
    """
    path = Path(path)
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % RECORD_BYTES:
        raise ValueError(f"{path}: {raw.size} bytes is not a whole number of CIFAR-10 records ({RECORD_BYTES} bytes "
                         f"each: 1 label byte + 3x32x32 pixels); the file is truncated or not the binary version")
    records = raw.reshape(-1, RECORD_BYTES)
    labels = records[:, 0].astype(np.int64)
    bad = np.flatnonzero(labels > 9)
    if bad.size:
        raise ValueError(f"{path}: record {int(bad[0])} has label {int(labels[bad[0]])}; CIFAR-10 labels are 0..9")
    images = records[:, 1:].reshape(-1, 3, 32, 32)
    return torch.from_numpy(images.copy()), torch.from_numpy(labels)


def load_cifar10(root: str | Path, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """The ``train`` (5 files) or ``test`` split from ``root`` (the ``cifar-10-batches-bin``
    directory or its parent), concatenated in file order.

    Raises:
        FileNotFoundError: a file of the split is missing (naming it and where to get the data).
        ValueError: ``split`` is neither ``train`` nor ``test``; a malformed file (see
            :func:`read_cifar10_bin`).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(root)
    if (root / "cifar-10-batches-bin").is_dir():
        root = root / "cifar-10-batches-bin"
    parts = []
    for name in TRAIN_FILES if split == "train" else TEST_FILES:
        if not (root / name).is_file():
            raise FileNotFoundError(f"{root / name} not found: pass the cifar-10-batches-bin directory of the binary "
                                    f"version (https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz)")
        parts.append(read_cifar10_bin(root / name))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
