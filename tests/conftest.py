import multiprocessing
import os
import random
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from hetero.data import Feature, FeatureRole, Jagged, TabularDataset


def pytest_configure(config):
    """The CUDA runtime reads CUDA_VISIBLE_DEVICES once, when a process first asks for its devices;
    torch's device_count() reads it again (NVML) until CUDA is initialised. Initialise it in pytest's
    processes before any test: a test that hides the GPUs from the processes it spawns (cpu_ranks)
    must not hide them from this one, whose later tests would then see CUDA "available" with no
    device to name ("Invalid device id"). A hook, not module code: a spawned rank imports this module
    to unpickle its function *before* it takes the hiding environment, and initialising CUDA there
    would show it the GPU it must not use (seen on an H100, run 9: "LOCAL_RANK=1 has no CUDA device")."""
    if torch.cuda.is_available():
        torch.cuda.init()
    torch.cuda.device_count()


GENRES = ["Action", "Comedy", "Drama", "Sci-Fi", "Children's"]


def write_ml100k(directory, n_users=40, n_items=60, n_ratings=1200, seed=0):
    """Write ml-100k in RecBole's atomic format; ratings depend on user and item so there is signal."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    users = ["user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token"]
    for u in range(1, n_users + 1):
        users.append(f"{u}\t{rng.randint(15, 70)}\t{rng.choice('MF')}\t{rng.choice(['student', 'writer', 'other'])}\t{rng.randint(10000, 99999)}")
    items = ["item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq"]
    for i in range(1, n_items + 1):
        items.append(f"{i}\tMovie {i}\t{rng.choice(['1977', '1995', '1996', 'unknown'])}\t{' '.join(rng.sample(GENRES, rng.randint(1, 3)))}")
    inter = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
    for _ in range(n_ratings):
        u, i = rng.randint(1, n_users), rng.randint(1, n_items)
        r = min(5, max(1, round(3 + (u % 3 - 1) + (i % 5 - 2) * 0.7 + rng.gauss(0, 0.7))))
        inter.append(f"{u}\t{i}\t{r}\t{880000000 + rng.randint(0, 10**6)}")
    for name, lines in (("user", users), ("item", items), ("inter", inter)):
        (directory / f"ml-100k.{name}").write_text("\n".join(lines) + "\n")
    return directory


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def movielens(ml_dir):
    """``hetero train`` flags for the demo's job file (examples/movielens.toml) on the files in
    ``ml_dir`` (written by :func:`write_ml100k`: no download)."""
    return ["--config", str(EXAMPLES / "movielens.toml"), "--data-dir", str(ml_dir)]


def criteo_job(directory, buckets=64):
    """examples/criteo.toml with ``buckets`` rows per table (tests' tables stay small); its path."""
    text = (EXAMPLES / "criteo.toml").read_text().replace("hash_buckets = 262144", f"hash_buckets = {buckets}")
    assert f"hash_buckets = {buckets}" in text
    path = Path(directory) / f"criteo_{buckets}.toml"
    path.write_text(text)
    return path


# Multi-rank tests run every rank on the CPU with gloo: one machine's single GPU cannot host two
# NCCL ranks, and parity with a CPU reference needs CPU arithmetic. The CUDA path of a
# multi-process job has its own test (tests/test_ps.py, one CUDA worker beside a CPU server).
CPU_RANKS = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def assert_parity(got, want, msg=None):
    """A placed run against the unplaced one: bitwise when the device part runs on the CPU (CI);
    on a GPU to fp32 rounding, since cuBLAS accumulates in another order than the CPU's kernels."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if torch.cuda.is_available():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=msg)
    else:
        assert torch.equal(got, want), msg


@pytest.fixture
def cpu_ranks(monkeypatch):
    """Processes this test spawns (mp.spawn, torchrun) see no GPU and use one thread each."""
    for k, v in CPU_RANKS.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def ml_dir(tmp_path):
    return write_ml100k(tmp_path / "ml-100k")


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """This machine calibrated once for the session (the planner's tests), in a directory of its own:
    under pytest-xdist (``make test``) once a worker. Not shared between workers: the planner adds what
    it measures later (an op's exact shapes, collectives, a disk) to the same file, and a test of one
    worker then planned with another worker's measurements (two planner tests failed so)."""
    from hetero.planner.calibration import calibrate

    directory = tmp_path_factory.mktemp("calibration")
    calibrate(directory)
    return directory


def make_dataset(n=600, seed=0):
    """Synthetic CTR data: two one-hot features, one bag, one wide-only cross, 3 dense features."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(1, 50, (n,), generator=g), torch.randint(1, 30, (n,), generator=g)
    bags = [torch.randint(1, 20, (int(k),), generator=g).tolist() for k in torch.randint(0, 4, (n,), generator=g)]
    dense = torch.randn(n, 3, generator=g)
    logit = (a % 7 - 3).float() * 0.5 + (b % 3 - 1).float() + dense[:, 0]
    label = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    specs = (Feature("a", 50), Feature("b", 30), Feature("c", 20, multi_hot=True),
             Feature("a_x_b", 50 * 30, role=FeatureRole.WIDE))
    feats = {"a": a, "b": b, "c": Jagged.from_lists(bags), "a_x_b": a * 30 + b}
    return TabularDataset(feats, dense, label, specs)


def criteo_lines(n, label=None, seed=0, categories=31):
    """``n`` rows of a Criteo TSV (label, 13 counts, 26 hex categories of ``categories`` values
    each; some empty), seeded."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        y = label if label is not None else rng.randint(0, 1)
        ints = [str(rng.randint(0, 50)) if rng.random() > 0.2 else "" for _ in range(13)]
        cats = [f"{rng.randint(0, categories - 1):08x}" if rng.random() > 0.1 else "" for _ in range(26)]
        rows.append("\t".join([str(y), *ints, *cats]))
    return "\n".join(rows) + ("\n" if rows else "")


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(r, n, port, fn, args, out):
    import os

    from hetero.parallel import init, shutdown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r))
    torch.set_num_threads(1)
    assert init() or n == 1  # one rank: no torchrun group; build_mesh joins a one-rank group itself
    ok = False
    try:
        result = fn(*args)
        if r == 0:
            torch.save(result, out)
        ok = True
    finally:
        shutdown(clean=ok)  # a failed rank skips the final barrier: mp.spawn then stops the others at once


# Spawned ranks start from a fork server that has imported torch and hetero once for the whole
# session: each rank then starts in milliseconds, not the seconds of a fresh interpreter's
# `import torch` (with 2 ranks a test, most of the suite's multi-rank time). The server is a
# fresh interpreter, not pytest's process: no threads, no CUDA, no test state are forked.
# The modules a run imports when it first needs them are preloaded too: numba and the kernels,
# scikit-learn's metrics, matplotlib, TensorBoard's writer, torch's compiler stack (torch.optim's
# first optimizer imports it), pyarrow - 5 s a rank a run when each rank imported them itself. Only
# imports: nothing here starts a thread (numba's pool starts at a kernel's first parallel call).
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload([
    "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.pipelining",
    "torch.distributed.fsdp", "torch._dynamo", "torch.utils.tensorboard", "numba", "pyarrow", "pyarrow.compute",
    "pyarrow.csv", "pyarrow.parquet", "sklearn.metrics", "matplotlib.pyplot", "tqdm.auto", "filelock",
    "hetero", "hetero.parallel", "hetero.planner.apply", "hetero.cli", "hetero.embedding._numba_kernels",
    "hetero.dynamic._kernels", "hetero.storage._kernels", "hetero.data._hash_kernels", "hetero.optim._adam_kernels"])


def spawn(fn, args=(), nprocs=2, env=None):
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` from the session's fork server: each
    process runs ``fn(rank, *args)`` with this process's environment as it is now (the server's
    is the one it started with) and ``env`` added, and raises like ``mp.spawn`` when one fails."""
    import torch.multiprocessing as mp

    return mp.start_processes(_in_environment, args=({**os.environ, **(env or {})}, fn, args), nprocs=nprocs,
                              join=True, start_method="forkserver")


def _in_environment(rank, environ, fn, args):
    # (this process imported the modules of fn and of this function before it took ``environ``: had one
    # of them initialised CUDA, hiding the GPUs now would hide nothing)
    assert not (environ.get("CUDA_VISIBLE_DEVICES") == "" and torch.cuda.is_initialized()), "CUDA started before the GPUs were hidden"
    os.environ.clear()
    os.environ.update(environ)
    if "OMP_NUM_THREADS" in environ:  # (read by OpenMP when the server loaded torch, not now)
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    fn(rank, *args)


class CliRun(NamedTuple):
    returncode: int
    stderr: str


def hetero_on_ranks(tmp_path, n, argv, env=None):
    """``torchrun --standalone --nproc-per-node n -m hetero *argv``, its ranks forked from the
    session's server (:func:`spawn`) with ``env`` added to this process's environment: the
    ranks' return code (0, or 1 when any failed) and their stderr, rank by rank. The launcher
    itself (its agent, restarts, network) is tested under torchrun elsewhere."""
    import torch.multiprocessing as mp

    # a directory of its own each call (a free port's number, used before, can come back within one test)
    logs = Path(tempfile.mkdtemp(prefix="ranks_", dir=tmp_path))
    code, failure = 0, ""
    try:
        spawn(_hetero_rank, args=(n, free_port(), list(argv), str(logs)), nprocs=n, env={**CPU_RANKS, **(env or {})})
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        code, failure = 1, str(e)
    return CliRun(code, "".join((logs / f"{r}.err").read_text() for r in range(n) if (logs / f"{r}.err").exists()) + failure)


def _hetero_rank(r, n, port, argv, logs):
    import sys

    from hetero.cli import main

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                      LOCAL_WORLD_SIZE=str(n))
    err = open(os.path.join(logs, f"{r}.err"), "w")  # (left open: the process ends with this function)
    os.dup2(err.fileno(), 2)  # the rank's stderr, as torchrun collects it
    code = main(argv)
    sys.stderr.flush()
    if code != 0:
        sys.exit(code)  # the other ranks are stopped, as torchrun stops them


def run_ranks(tmp_path, n, fn, *args):
    """Run ``fn(*args)`` on ``n`` gloo ranks (spawned processes; ``fn`` importable at module
    level) and return rank 0's result: the N-ranks side of an "N ranks equal 1 process" test."""
    out = tmp_path / f"rank0_{fn.__name__}_{n}.pt"
    spawn(_rank_main, args=(n, free_port(), fn, args, str(out)), nprocs=n, env=CPU_RANKS)
    return torch.load(out, map_location="cpu", weights_only=False)


def load_example(name):
    """The module of ``examples/<name>.py`` (examples live outside the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_trains_as_one_process(make_model, batches, losses, parameters, lr=0.1, atol=1e-5):
    """The one-process side of an "N ranks equal 1 process" test: ``make_model()`` (seeded 0)
    trained by torch's SGD (``lr``) on ``batches`` of ``(x, y)`` with cross entropy has the
    per-step ``losses`` and the trained ``parameters`` (name -> tensor) the ranks reported.
    Returns the reference model."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    want = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
    assert losses == pytest.approx(want, abs=atol)
    assert set(parameters) == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        # (the reference trains on the CPU; a plan's device parameters may be on a GPU)
        torch.testing.assert_close(parameters[name].cpu(), p.detach(), atol=atol, rtol=atol, msg=lambda m: f"{name}: {m}")
    return ref
