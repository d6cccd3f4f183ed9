"""The seed MNIST example on idx files written here, and the idx reader."""

import gzip
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hetero.data import load_mnist, read_idx

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mnist_host_device.py"


def _example():
    spec = importlib.util.spec_from_file_location("mnist_host_device", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_idx(path, array, gz=False):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    with gzip.open(path, "wb") if gz else open(path, "wb") as f:  # closed: a gzip stream ends on close
        f.write(data)


@pytest.fixture
def mnist_dir(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 640), ("t10k", 200)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 40, (n, 28, 28))
        images[np.arange(n), labels, :] = 255  # a learnable pattern: row <label> is bright
        gz = split == "train"  # the reader finds NAME or NAME.gz
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte{'.gz' if gz else ''}", images, gz=gz)
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte", labels)
    return tmp_path


def test_idx_reader_shapes_and_errors(mnist_dir, tmp_path):
    images, labels = load_mnist("train", mnist_dir)
    assert images.shape == (640, 784) and images.dtype == torch.uint8 and labels.dtype == torch.int64
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x00\x00\x0d\x01" + (5).to_bytes(4, "big") + b"abcde")
    with pytest.raises(ValueError, match=r"bad: not an idx file of unsigned bytes \(magic 00000d01"):
        read_idx(bad)
    bad.write_bytes(b"\x00\x00\x08\x01" + (9).to_bytes(4, "big") + b"abc")
    with pytest.raises(ValueError, match=r"header declares shape \[9\] \(9 bytes\) but 3 bytes follow"):
        read_idx(bad)
    with pytest.raises(ValueError, match="unknown MNIST split 'dev'; valid splits are 'train', 'test'"):
        load_mnist("dev", mnist_dir)


def _losses(out):
    lines = [ln for ln in out.splitlines() if ln.startswith("epoch:")]
    assert all(re.fullmatch(r"epoch: 0, step: \d+, loss is [0-9.e+-]+", ln) for ln in lines), lines
    return [float(ln.rsplit(" ", 1)[1]) for ln in lines]


def test_placed_run_equals_unplaced_run_step_by_step(mnist_dir, capsys):
    ex = _example()
    args = ["--data-dir", str(mnist_dir), "--log-every", "2", "--max-steps", "20", "--no-shuffle"]
    acc = ex.main(args)
    placed = capsys.readouterr()
    assert "submod_0 [host]: matmul@fc1, add@fc1" in placed.err  # the explain report
    ex.main([*args, "--no-placement"])
    unplaced = capsys.readouterr().out
    assert len(_losses(placed.out)) == 10
    np.testing.assert_allclose(_losses(placed.out), _losses(unplaced), rtol=0, atol=1e-5)
    assert placed.out.strip().splitlines()[-1] == f"test accuracy: {acc:.4f}" and acc > 0.5


def test_init_weights_are_loaded_and_checked(mnist_dir, tmp_path, capsys):
    ex = _example()
    rng = np.random.default_rng(0)
    shapes = {"w1": (784, 512), "b1": (512,), "w2": (512, 512), "b2": (512,), "w3": (512, 10), "b3": (10,)}
    arrays = {k: (rng.standard_normal(s) * 0.01).astype(np.float32) for k, s in shapes.items()}
    np.savez(tmp_path / "w.npz", **arrays)
    args = ["--data-dir", str(mnist_dir), "--max-steps", "4", "--log-every", "1", "--no-shuffle",
            "--init-weights", str(tmp_path / "w.npz")]
    ex.main(args)
    first = _losses(capsys.readouterr().out)
    ex.main([*args, "--seed", "7"])  # other seed, same given weights and order: same losses
    assert _losses(capsys.readouterr().out) == first
    arrays["w2"] = arrays["w2"][:, :10]
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=r"bad.npz: array 'w2' has shape \(512, 10\), the network needs \(512, 512\)"):
        ex.main([*args[:-1], str(tmp_path / "bad.npz")])


def test_torchrun_two_ranks_print_the_single_process_losses(mnist_dir, tmp_path, cpu_ranks):
    import subprocess
    import sys

    common = ["--data-dir", str(mnist_dir), "--no-shuffle", "--max-steps", "12", "--log-every", "4"]
    single = subprocess.run([sys.executable, str(EXAMPLE), "--batch-size", "32", *common],
                            capture_output=True, text=True, check=True)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(EXAMPLE), "--batch-size", "16", *common],
                         capture_output=True, text=True, check=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    np.testing.assert_allclose(_losses(two.stdout), _losses(single.stdout), rtol=0, atol=1e-5)
    assert len(_losses(two.stdout)) == 3
