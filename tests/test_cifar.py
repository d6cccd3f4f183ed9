"""CIFAR-10 binary reader and the ResNet-50 data-parallel example, on files written in that layout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hetero.data import load_cifar10, read_cifar10_bin

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "resnet50_cifar10.py"


def write_cifar(directory: Path, per_file: int = 12, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Records as the format describes them: a label byte, then the R, G and B planes, row-major."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        labels = rng.integers(0, 10, per_file, dtype=np.uint8)
        images = rng.integers(0, 256, (per_file, 3, 32, 32), dtype=np.uint8)
        with open(directory / name, "wb") as f:
            for lab, img in zip(labels, images):
                f.write(bytes([lab]))
                for channel in range(3):
                    f.write(img[channel].tobytes(order="C"))
        written[name] = (images, labels)
    return written


def test_reader_returns_the_records_in_file_order(tmp_path):
    written = write_cifar(tmp_path / "cifar-10-batches-bin")
    images, labels = read_cifar10_bin(tmp_path / "cifar-10-batches-bin" / "data_batch_2.bin")
    assert images.dtype == torch.uint8 and images.shape == (12, 3, 32, 32) and labels.dtype == torch.int64
    assert np.array_equal(images.numpy(), written["data_batch_2.bin"][0])
    assert np.array_equal(labels.numpy(), written["data_batch_2.bin"][1])
    train_x, train_y = load_cifar10(tmp_path, "train")  # the parent directory works too
    assert train_x.shape == (60, 3, 32, 32)
    assert np.array_equal(train_y.numpy(), np.concatenate([written[f"data_batch_{i}.bin"][1] for i in range(1, 6)]))
    assert load_cifar10(tmp_path / "cifar-10-batches-bin", "test")[0].shape == (12, 3, 32, 32)


def test_bad_files_name_the_file_and_the_fix(tmp_path):
    d = tmp_path / "cifar-10-batches-bin"
    write_cifar(d)
    f = d / "data_batch_3.bin"
    f.write_bytes(f.read_bytes()[:-5])
    with pytest.raises(ValueError) as e:
        read_cifar10_bin(f)
    assert str(e.value) == (f"{f}: {12 * 3073 - 5} bytes is not a whole number of CIFAR-10 records (3073 bytes each: 1 label "
                            f"byte + 3x32x32 pixels); the file is truncated or not the binary version")
    g = d / "data_batch_4.bin"
    raw = bytearray(g.read_bytes())
    raw[3073 * 2] = 11
    g.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"data_batch_4.bin: record 2 has label 11; CIFAR-10 labels are 0..9"):
        read_cifar10_bin(g)
    (d / "test_batch.bin").unlink()
    with pytest.raises(FileNotFoundError, match="test_batch.bin not found: pass the cifar-10-batches-bin directory"):
        load_cifar10(d, "test")


@pytest.mark.parametrize("ranks", [1, 2])
def test_resnet50_example_trains_data_parallel(tmp_path, ranks, cpu_ranks):
    write_cifar(tmp_path / "cifar-10-batches-bin")
    args = [str(EXAMPLE), "--data-dir", str(tmp_path), "--batch-size", "4", "--max-steps", "2", "--eval-samples", "8",
            "--log-every", "1"]
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc-per-node", str(ranks)]
    run = subprocess.run([*launch, *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert [ln.split(",")[1] for ln in lines if ln.startswith("epoch: 0")] == [" step: 0", " step: 1"]  # rank 0 prints
    result = json.loads(lines[-1])
    assert result["steps"] == 2 and result["world_size"] == ranks and np.isfinite(result["last_loss"])
    crcs = result["weights_crc_per_rank"]
    assert len(crcs) == ranks and len(set(crcs)) == 1  # the replicas stayed identical (DDP)
    assert crcs[0] != result["initial_weights_crc"]  # and they trained
    assert 0.0 <= result["test_accuracy"] <= 1.0


def test_resnet50_example_without_data_is_one_line_naming_the_fix(tmp_path):
    run = subprocess.run([sys.executable, str(EXAMPLE), "--data-dir", str(tmp_path / "nowhere")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        f"hetero: error: {tmp_path / 'nowhere' / 'data_batch_1.bin'} not found: pass the cifar-10-batches-bin directory")
