"""``hetero``'s command line: the parser of every command and its flags, a job file's
``[train]`` section merged under the command line (:func:`parse_args`), and the checks of the
job's numbers (:func:`check_train_args`). Only the CLI (``hetero.cli``) uses it; nothing below
it sees ``argparse``."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetero.cli_plan import add_plan_arguments
from hetero.jobfile import JobFile, read_job_file
from hetero.models.dlrm import DLRMConfig
from hetero.models.wide_deep import WideDeepConfig
from hetero.optim import SparseOptimizerKind
from hetero.parallel.pipeline_plan import Schedule
from hetero.ps import PSMode
from hetero.train import CheckpointFormat

DESCRIPTION = "Host/device heterogeneous training for PyTorch: hetero train, plan, predict, data prepare, checkpoint merge."


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _train_arguments(t: argparse.ArgumentParser, train: bool = True) -> None:
    """``hetero train``'s flags (``hetero plan`` takes them too, ``--plan`` apart: the job it plans)."""
    g = t.add_argument_group("data")
    g.add_argument("--config", type=Path, help="a job config file (TOML): the data, its schema, and any of these "
                   "flags by name; flags given here override it (see hetero.jobfile; examples/movielens.toml)")
    g.add_argument("--data-path", type=Path, help="the data file (instead of the job file's path)")
    g.add_argument("--data-dir", type=Path, help="the directory the job file's relative paths are in (default: the "
                   "fetched data set's, else the current directory)")
    g.add_argument("--stream", action="store_true", help="a job file's data streamed from disk in blocks, not read "
                   "into memory (needs valid_path and test_path in [data]; see hetero.data.stream)")
    g.add_argument("--prepared", type=Path, help="train on a cache written by `hetero data prepare` (memory-mapped)")
    g.add_argument("--shuffle-window", type=int, default=1 << 17, help="--stream: rows shuffled together")
    g.add_argument("--cache-dir", type=Path, help="download cache (default $HETERO_CACHE or ~/.cache/hetero)")
    g.add_argument("--batch-size", type=int, default=256, help="global batch (split over the ranks under torchrun)")
    g.add_argument("--seed", type=int, default=0, help="seeds the split, the shuffling and the initialisation")
    g = t.add_argument_group("model")
    g.add_argument("--model", choices=["wide_deep", "dlrm"], default="wide_deep",
                   help="Wide & Deep (--hidden: its MLP) or DLRM (--bottom, --hidden: the top MLP)")
    g.add_argument("--bottom", type=_ints, default=DLRMConfig.bottom, help="DLRM: the bottom MLP's widths")
    g.add_argument("--embedding-dim", type=int, default=WideDeepConfig.embedding_dim, help="deep tables' row width")
    g.add_argument("--hidden", type=_ints, default=(256, 128), help="MLP widths, comma-separated")
    g.add_argument("--dropout", type=float, default=0.3, help="dropout after each hidden layer of the MLP")
    g = t.add_argument_group("optimizers")
    kinds = [k.value for k in SparseOptimizerKind]
    g.add_argument("--dense-lr", type=float, default=1e-3, help="learning rate of Adam on the device MLP (> 0)")
    g.add_argument("--deep-optimizer", choices=kinds, default="lazy_adam", help="sparse optimizer of the deep tables")
    g.add_argument("--deep-lr", type=float, default=1e-2, help="learning rate of the deep tables (> 0)")
    g.add_argument("--wide-optimizer", choices=kinds, default="ftrl", help="sparse optimizer of the wide tables")
    g.add_argument("--wide-lr", type=float, default=0.05, help="learning rate of the wide tables (> 0)")
    g.add_argument("--ftrl-l1", type=float, default=0.0, help="FTRL's L1 strength (>= 0)")
    g.add_argument("--ftrl-l2", type=float, default=1.0, help="FTRL's L2 strength (>= 0)")
    g = t.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=8, help="passes over the training split")
    g.add_argument("--run-dir", type=Path, default=Path("runs/wide_deep"), help="where the run's checkpoints, metrics "
                   "and plots go (one run per directory: see --resume, --overwrite)")
    g.add_argument("--resume", nargs="?", const="yes", choices=["yes", "auto"],
                   help="continue from RUN_DIR's checkpoint; 'auto': if it exists (for torchrun --max-restarts)")
    g.add_argument("--overwrite", action="store_true", help="start a new run in a RUN_DIR that holds another run's "
                   "checkpoint: its files (checkpoints, metrics, plots, plan) are removed once the job's checks pass")
    g.add_argument("--checkpoint-format", choices=[f.value for f in CheckpointFormat],
                   help="integrated (default): RUN_DIR/checkpoint.pt, written whole by rank 0; sharded (the default with "
                        "--ps-servers): RUN_DIR/checkpoint.dcp, each rank writing its part (torch.distributed.checkpoint); "
                        "both resume at any world size")
    g.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: each epoch)")
    g.add_argument("--max-steps", type=int, help="stop after this many steps in total")
    g.add_argument("--patience", type=int, default=0, help="stop after this many epochs without a better validation "
                   "AUC (0: never early); implies --keep-best")
    g.add_argument("--keep-best", action="store_true", help="also keep the best epoch's checkpoint (best.pt) and score "
                   "the test split with it")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--prefetch", action="store_true", help="prepare the next batch's lookups on a worker thread")
    g.add_argument("--threads", type=int, help="threads of the host embedding kernels (default: torch's)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                   help="ZeRO for the dense part over the data-parallel ranks: 1 Adam states, 2 + gradients, "
                        "3 + parameters (host tables keep their own sparse exchange)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages, one per rank (under torchrun --nproc-per-node "
                   "PP): stage 0 the host tables and the first MLP layers, the later stages the rest of the MLP")
    g.add_argument("--schedule", choices=[s.value for s in Schedule if not s.interleaved],
                   default=Schedule.ONE_F_ONE_B.value, help="pipeline schedule (with --pp)")
    g.add_argument("--micro-batches", type=int, help="micro-batches per batch (with --pp; default: --pp)")
    g.add_argument("--tp", type=int, default=1, help="operator-parallel ranks for the deep MLP (under torchrun "
                   "--nproc-per-node TP; the tables stay replicated on each host)")
    g.add_argument("--table-sharding", choices=["replicated", "row"], default="replicated",
                   help="under torchrun: every rank holds whole tables, or a 1/N block of each table's rows")
    g = t.add_argument_group("parameter server (under torchrun: the last N processes serve the tables)")
    g.add_argument("--ps-servers", type=int, default=0, help="server processes (0: no parameter server)")
    g.add_argument("--ps-mode", choices=[m.value for m in PSMode], default="sync",
                   help="sync: equal to one process on the global batch; async: pushes applied on arrival; bounded: "
                        "async with a worker row cache of at most --ps-staleness steps")
    g.add_argument("--ps-staleness", type=int, default=0, help="bounded mode: steps a pulled row may be reused")
    g.add_argument("--ps-server-memory-mb", type=float, default=0.0,
                   help="each server's memory budget for its shard of rows and optimizer state (0: unlimited)")
    g.add_argument("--ps-timeout", type=float, default=60.0, help="seconds a worker waits for a server's answer")
    g = t.add_argument_group("planning (hetero.plan)")
    if train:
        g.add_argument("--plan", help="auto: plan the job for this machine and world size (rank 0 plans, every rank "
                       "applies it: dense optimizer state, recompute, table placement, ZeRO); or a plan file from "
                       "`hetero plan`. The plan is written to RUN_DIR/plan.json")
    add_plan_arguments(g)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    defaults = argparse.ArgumentDefaultsHelpFormatter  # --help shows every default
    t = sub.add_parser("train", help="train Wide & Deep with host-resident embedding tables", formatter_class=defaults)
    _train_arguments(t)
    pl = sub.add_parser("plan", help="plan a job (hetero.plan): placement and parallel strategy under memory budgets",
                        formatter_class=defaults)
    _train_arguments(pl, train=False)
    g = pl.add_argument_group("the plan")
    g.add_argument("--world-size", type=int, default=1, help="ranks the job will run on")
    g.add_argument("--out", type=Path, default=Path("plan.json"), help="the plan file to write")
    d = sub.add_parser("data", help="data tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    dp = dsub.add_parser("prepare", help="encode a job file's data once into a columnar cache (hetero.data.prepare)",
                        formatter_class=defaults)
    dp.add_argument("--config", type=Path, required=True, help="the job config file: its [data] and [schema]")
    dp.add_argument("--out", type=Path, required=True, help="the cache directory to write (must not exist)")
    dp.add_argument("--data-path", type=Path, help="the file, if [data] names none")
    dp.add_argument("--data-dir", type=Path, help="the directory the job file's relative paths are in")
    dp.add_argument("--cache-dir", type=Path, help="download cache (default $HETERO_CACHE or ~/.cache/hetero)")
    dp.add_argument("--seed", type=int, default=0, help="seeds a random split")
    pr = sub.add_parser("predict", help="score a schema-described file with a run's checkpoint (hetero.predict)",
                        formatter_class=defaults)
    pr.add_argument("--checkpoint", type=Path, required=True, help="an integrated checkpoint of a `hetero train "
                    "--config` run (best.pt, checkpoint.pt, a merged file): it holds the model, encoding and reader "
                    "settings the run used")
    pr.add_argument("--data", type=Path, required=True, help="the file to score (with the schema's columns)")
    pr.add_argument("--out", type=Path, required=True, help="scores.parquet or scores.csv (score, and label when the "
                    "file has the label column: AUC and log loss are then printed)")
    pr.add_argument("--config", type=Path, help="a job config file to locate the run's side tables (joins); its "
                    "[data] reader settings must be the run's (by default the file is read as the run read its data)")
    pr.add_argument("--id-column", help="a column of --data copied into the scores beside each row's score (a key)")
    pr.add_argument("--data-dir", type=Path, help="the directory the job file's relative paths are in")
    pr.add_argument("--cache-dir", type=Path, help="download cache (default $HETERO_CACHE or ~/.cache/hetero)")
    pr.add_argument("--batch-size", type=int, default=8192, help="rows scored at a time")
    c = sub.add_parser("checkpoint", help="checkpoint tools")
    csub = c.add_subparsers(dest="action", required=True)
    m = csub.add_parser("merge", help="merge a sharded checkpoint (a checkpoint.dcp directory) into one integrated file",
                        formatter_class=defaults)
    m.add_argument("source", type=Path, help="the checkpoint.dcp directory")
    m.add_argument("output", type=Path, help="the integrated checkpoint file to write (atomically)")
    return p


def train_flags(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """``hetero train``'s flags, each mapped to whether it takes a value (argparse keeps its
    actions in ``_actions``, the one place that lists them)."""
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    return {a.option_strings[-1]: a.nargs != 0 for a in train._actions if a.option_strings and a.dest != "help"}


def parse_args(argv: list[str], parser: argparse.ArgumentParser | None = None
               ) -> tuple[argparse.Namespace, JobFile | None]:
    """The command line ``argv`` (without the program's name) and, for ``train --config``, its
    job file, whose ``[train]`` flags come first so the command line's win.

    Raises:
        FileNotFoundError, ValueError: the job file is missing or bad (see :func:`read_job_file`).
    """
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if args.command not in ("train", "plan") or args.config is None:
        return args, None
    job = read_job_file(args.config, train_flags(parser))
    file_argv = list(job.argv)
    if args.command == "plan" and "--plan" in file_argv:  # what `hetero plan` makes: a train flag, not its own
        at = file_argv.index("--plan")
        del file_argv[at : at + 2]
    at = argv.index(args.command) + 1  # the file's flags first: the command line's, after them, win
    return parser.parse_args([*argv[:at], *file_argv, *argv[at:]]), job


# flag -> (lowest value, whether the lowest is allowed itself); checked for train and plan
_BOUNDS = {
    "dense_lr": (0.0, False), "deep_lr": (0.0, False), "wide_lr": (0.0, False), "ftrl_l1": (0.0, True),
    "ftrl_l2": (0.0, True), "dropout": (0.0, True), "epochs": (1, True), "batch_size": (1, True),
    "embedding_dim": (1, True), "checkpoint_every": (0, True), "max_steps": (1, True), "patience": (0, True),
    "pp": (1, True), "tp": (1, True), "micro_batches": (1, True), "threads": (1, True), "ps_servers": (0, True),
    "ps_staleness": (0, True), "ps_server_memory_mb": (0.0, True), "ps_timeout": (0.0, False),
    "shuffle_window": (1, True),
}


def check_train_args(args: argparse.Namespace) -> None:
    """Check the job's numbers before anything runs: learning rates positive (a learning rate of
    0 trains nothing, silently; FTRL divides by it), counts and sizes in range.

    Raises:
        ValueError: naming the flag, its job-file key, the value and the range.
    """
    for key, (low, inclusive) in _BOUNDS.items():
        value = getattr(args, key, None)
        if value is None or isinstance(value, bool):
            continue
        if value < low or (value == low and not inclusive) or value != value:  # (NaN too)
            flag = "--" + key.replace("_", "-")
            bound = f">= {low}" if inclusive else f"> {low}"
            raise ValueError(f"{flag} (job file [train] {key}) = {value}: give a value {bound}")
    if args.dropout >= 1:
        raise ValueError(f"--dropout (job file [train] dropout) = {args.dropout}: give a value in [0, 1)")
    for key in ("hidden", "bottom"):
        if any(w < 1 for w in getattr(args, key, ())):
            raise ValueError(f"--{key} (job file [train] {key}) = {list(getattr(args, key))}: give widths >= 1")


