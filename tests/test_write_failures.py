"""A full disk says so: a checkpoint, export or predict output write that fails names the file and
the cause in one line, and the previous file still loads. The failure is the kernel's own: a
child process under a file size limit (``RLIMIT_FSIZE``: ``EFBIG``, ``SIGXFSZ`` ignored)."""

import subprocess
import sys

import torch

from hetero.checkpoint import load_checkpoint, save_checkpoint

LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))  # 64 KiB a file
from hetero.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _limited(*argv):
    return subprocess.run([sys.executable, "-c", LIMITED, *argv], capture_output=True, text=True, timeout=300)


def test_a_failed_checkpoint_write_names_the_file_and_cause_and_the_previous_one_loads(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"w": torch.arange(4.0)}, path)
    code = ("import resource, signal, torch\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))\n"
            "from hetero.checkpoint import save_checkpoint\n"
            f"save_checkpoint({{'w': torch.zeros(1 << 18)}}, {str(path)!r})\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert got.returncode != 0
    last = got.stderr.strip().splitlines()[-1]
    assert last.startswith("OSError: [Errno 27] cannot write") and str(path) in last and "EFBIG" in last, got.stderr
    assert torch.equal(load_checkpoint(path)["w"], torch.arange(4.0))  # the previous checkpoint, intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temporary file left


def test_train_and_predict_report_a_failed_write_in_one_line(tmp_path):
    from test_dynamic_job import _csv

    _csv(tmp_path / "data.csv", n=400)
    (tmp_path / "job.toml").write_text(f'[data]\npath = "{tmp_path / "data.csv"}"\n[schema]\nlabel = "label"\n'
                                       f'[[schema.categorical]]\ncolumn = "item"\n[[schema.dense]]\ncolumn = "age"\n')
    got = _limited("train", "--config", str(tmp_path / "job.toml"), "--no-progress", "--epochs", "1",
                   "--embedding-dim", "64", "--hidden", "256", "--run-dir", str(tmp_path / "run"))  # > 64 KiB of weights
    err = [line for line in got.stderr.strip().splitlines() if "error" in line or "Traceback" in line]
    assert got.returncode == 1 and len(err) == 1 and err[0].startswith("hetero: error: "), got.stderr
    assert "cannot write" in err[0] and "checkpoint.pt" in err[0] and "EFBIG" in err[0], err
    from hetero.cli import main

    assert main(["train", "--config", str(tmp_path / "job.toml"), "--no-progress", "--epochs", "1",
                 "--run-dir", str(tmp_path / "ok")]) == 0
    rows = "label,user,item,age,genres\n" + "".join(f"1,u1,{i % 20},0.5,g1\n" for i in range(20000))
    (tmp_path / "many.csv").write_text(rows)
    got = _limited("predict", "--checkpoint", str(tmp_path / "ok" / "checkpoint.pt"), "--data",
                   str(tmp_path / "many.csv"), "--out", str(tmp_path / "s.csv"))
    err = [line for line in got.stderr.strip().splitlines() if "error" in line or "Traceback" in line]
    assert got.returncode == 1 and len(err) == 1 and "cannot write" in err[0] and "s.csv" in err[0], got.stderr
    assert not (tmp_path / "s.csv").exists()
