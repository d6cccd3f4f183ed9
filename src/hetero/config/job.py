"""The job configuration: one typed value, :class:`JobConfig`, that says everything a run of
``hetero train`` (and ``hetero plan``) needs - its data, schema, model, optimizers, training
loop, parallel dimensions, parameter server, checkpoints, planner and logging - in sections of
dataclasses, as torchtitan's ``JobConfig`` does.

:mod:`hetero.config.manager` builds it from the defaults here < a job file (TOML) < the command
line (``--section.key value``, parsed by ``tyro`` from these dataclasses; each key's old flag,
``--batch-size``, is an alias) and validates it once (:func:`hetero.config.manager.validate`).
Every key's meaning is its attribute docstring (what ``--help`` shows and the generated
reference, ``docs/job-file.md``, lists), its old flag an :func:`alias` and its range a
:class:`Bounds` marker, which the validation reads: one declaration, read by all three. Nothing
below the CLI sees the command line: components receive their section.
"""

import ast
import dataclasses
import enum
import functools
import inspect
import re
import textwrap
import typing
from pathlib import Path
from typing import Annotated, Any

import tyro
from tyro.constructors import PrimitiveConstructorSpec

from hetero.data.reader_config import ReaderConfig
from hetero.data.schema import Schema
from hetero.data.split import Split
from hetero.models.build import ModelKind
from hetero.optim import SparseOptimizerKind
from hetero.parallel.pipeline_plan import Schedule
from hetero.ps.config import PSMode
from hetero.storage.cache import CachePolicy
from hetero.train.config import CheckpointFormat


@dataclasses.dataclass(frozen=True)
class Bounds:
    """A numeric key's valid range (each element's, for a list), checked by
    :func:`hetero.config.manager.validate`.

    Attributes:
        low: the lowest valid value (``None``: unbounded).
        inclusive: whether ``low`` itself is valid.
        below: a value every valid one is below (``None``: unbounded).
    """

    low: float | None = None
    inclusive: bool = True
    below: float | None = None


def alias(flag: str) -> Any:  # noqa: ANN401 - tyro's argument marker
    """The ``tyro`` marker that makes ``flag``, a key's command-line flag from before sections
    (``--batch-size``), an alias of the key (``--training.batch_size``; ``-`` and ``_`` read
    alike). The flag's name is also the key's name in a job file's ``[train]`` table."""
    return tyro.conf.arg(aliases=("--" + flag[2:].replace("-", "_"),))


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    """What a section's key declares: its type, meaning, old flag and bounds.

    Attributes:
        type: its type without annotations (``int | None``).
        help: its attribute docstring.
        flag: its old flag (``--batch-size``), or ``None``.
        bounds: its :class:`Bounds`, or ``None``.
    """

    type: Any
    help: str
    flag: str | None
    bounds: Bounds | None


def keys(section: type) -> dict[str, KeyInfo]:
    """A section's command-line keys (its fields ``tyro`` shows), in order, each's :class:`KeyInfo`."""
    plain = typing.get_type_hints(section)
    extra = typing.get_type_hints(section, include_extras=True)
    docs = _docstrings(section)
    out = {}
    for f in dataclasses.fields(section):
        meta = getattr(extra[f.name], "__metadata__", ())
        if dataclasses.is_dataclass(plain[f.name]) or any(m is tyro.conf.Suppress for m in meta):
            continue
        aliases = next((m.aliases for m in meta if getattr(m, "aliases", None)), ())
        flag = "--" + aliases[0][2:].replace("_", "-") if aliases else None
        out[f.name] = KeyInfo(plain[f.name], docs.get(f.name, ""), flag,
                              next((m for m in meta if isinstance(m, Bounds)), None))
    return out


@functools.cache  # (parsing a class's source costs 18 ms; a job's load asks for each section's some 5 times)
def _docstrings(cls: type) -> dict[str, str]:
    """A class's attribute docstrings (the string right after a field), one line each; read-only
    (cached: the same dict on every call)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}


def _ints(args: list[str]) -> tuple[int, ...]:
    return tuple(int(x) for a in args for x in a.split(",") if x)


# widths as "256,128" (the old flag's form) or "256 128"
INTS = PrimitiveConstructorSpec(nargs="+", metavar="INT[,INT...]", instance_from_str=_ints,
                                is_instance=lambda x: isinstance(x, tuple),
                                str_from_instance=lambda t: [str(v) for v in t])


def _paths(args: list[str]) -> Path | tuple[Path, ...]:
    paths = tuple(Path(a) for a in args)
    return paths[0] if len(paths) == 1 else paths


PATHS = PrimitiveConstructorSpec(nargs="+", metavar="PATH [PATH ...]", instance_from_str=_paths,
                                 is_instance=lambda x: isinstance(x, (Path, tuple)),
                                 str_from_instance=lambda x: [str(p) for p in (x if isinstance(x, tuple) else (x,))])


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"500MB"``, ``"1.5g"``, ``"1000000"`` as bytes.

    Raises:
        ValueError: not a size (naming the units).
    """
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
             "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in units:
        raise ValueError(f"{text!r} is not a size: give a number of bytes with a unit of "
                         f"{sorted(u for u in units if u)} (e.g. 2GiB)")
    return int(float(m.group(1)) * units[m.group(2).lower()])


BYTES = PrimitiveConstructorSpec(nargs=1, metavar="SIZE", instance_from_str=lambda a: parse_bytes(a[0]),
                                 is_instance=lambda x: isinstance(x, int), str_from_instance=lambda x: [str(x)])


class TableSharding(enum.Enum):
    """How host tables lie over the data-parallel ranks."""

    REPLICATED = "replicated"  # every rank holds whole tables
    ROW = "row"  # each rank a 1/N block of every table's rows


class Resume(enum.Enum):
    """Whether a run continues from its run directory's checkpoint."""

    YES = "yes"  # it must exist
    AUTO = "auto"  # if it exists (for torchrun --max-restarts)


@dataclasses.dataclass(kw_only=True)
class Data:
    """``[data]``: where the job's data is and how it is read and split (reader and split keys
    are job-file keys: see the reference)."""

    path: Annotated[Path | tuple[Path, ...] | None, alias("--data-path"), PATHS] = None
    """The data: a file, a directory of part files, a glob, or a list of these."""
    dir: Annotated[Path | None, alias("--data-dir")] = None
    """The directory relative paths are in (default: the fetched data set's, else the current directory)."""
    fetch: str | None = None
    """A public data set hetero downloads (checked); relative paths are in it."""
    cache_dir: Annotated[Path | None, alias("--cache-dir")] = None
    """Download cache (default $HETERO_CACHE or ~/.cache/hetero)."""
    stream: Annotated[bool, alias("--stream")] = False
    """Stream the data from disk in blocks (needs valid_path and test_path)."""
    prepared: Annotated[Path | None, alias("--prepared")] = None
    """Train on a cache written by `hetero data prepare` (memory-mapped)."""
    shuffle_window: Annotated[int, alias("--shuffle-window"), Bounds(low=1)] = 1 << 17
    """Rows shuffled together when streaming."""
    reader: tyro.conf.Suppress[ReaderConfig] = ReaderConfig()
    split: tyro.conf.Suppress[Split] = Split()


@dataclasses.dataclass(kw_only=True)
class Model:
    """``[model]``: the network over the host tables."""

    name: Annotated[ModelKind, alias("--model")] = ModelKind.WIDE_DEEP
    """Wide & Deep (hidden: its MLP) or DLRM (bottom, hidden: the top MLP)."""
    embedding_dim: Annotated[int, alias("--embedding-dim"), Bounds(low=1)] = 16
    """Deep tables' row width."""
    hidden: Annotated[tuple[int, ...], alias("--hidden"), INTS, Bounds(low=1)] = (256, 128)
    """MLP widths."""
    bottom: Annotated[tuple[int, ...], alias("--bottom"), INTS, Bounds(low=1)] = (64,)
    """DLRM: the bottom MLP's widths."""
    dropout: Annotated[float, alias("--dropout"), Bounds(low=0.0, below=1.0)] = 0.3
    """Dropout after each hidden layer of the MLP."""


@dataclasses.dataclass(kw_only=True)
class Optimizer:
    """``[optimizer]``: the dense optimizer (Adam) and the host tables' sparse optimizers."""

    dense_lr: Annotated[float, alias("--dense-lr"), Bounds(low=0.0, inclusive=False)] = 1e-3
    """Learning rate of Adam on the device MLP."""
    deep: Annotated[SparseOptimizerKind, alias("--deep-optimizer")] = SparseOptimizerKind.LAZY_ADAM
    """Sparse optimizer of the deep tables."""
    deep_lr: Annotated[float, alias("--deep-lr"), Bounds(low=0.0, inclusive=False)] = 1e-2
    """Learning rate of the deep tables."""
    wide: Annotated[SparseOptimizerKind, alias("--wide-optimizer")] = SparseOptimizerKind.FTRL
    """Sparse optimizer of the wide tables."""
    wide_lr: Annotated[float, alias("--wide-lr"), Bounds(low=0.0, inclusive=False)] = 0.05
    """Learning rate of the wide tables."""
    ftrl_l1: Annotated[float, alias("--ftrl-l1"), Bounds(low=0.0)] = 0.0
    """FTRL's L1 strength."""
    ftrl_l2: Annotated[float, alias("--ftrl-l2"), Bounds(low=0.0)] = 1.0
    """FTRL's L2 strength."""


@dataclasses.dataclass(kw_only=True)
class Training:
    """``[training]``: the loop."""

    batch_size: Annotated[int, alias("--batch-size"), Bounds(low=1)] = 256
    """Global batch (split over the data-parallel ranks)."""
    seed: Annotated[int, alias("--seed"), Bounds(low=0, below=2**32)] = 0
    """Seeds the split, the shuffling and the initialisation."""
    epochs: Annotated[int, alias("--epochs"), Bounds(low=1)] = 8
    """Passes over the training split."""
    max_steps: Annotated[int | None, alias("--max-steps"), Bounds(low=1)] = None
    """Stop after this many steps in total."""
    patience: Annotated[int, alias("--patience"), Bounds(low=0)] = 2
    """Stop after this many epochs without a better validation AUC (0: never early); implies keep_best."""
    eval_batch_size: Annotated[int, alias("--eval-batch-size"), Bounds(low=1)] = 8192
    """Samples per evaluation forward (validation and test; any size fits an SSD tier's cache)."""
    prefetch: Annotated[bool, alias("--prefetch")] = False
    """Prepare the next batch's lookups on a worker thread."""
    threads: Annotated[int | None, alias("--threads"), Bounds(low=1)] = None
    """Compute threads: torch's and the host kernels' (default: 1 on <= 2 cores, else torch's)."""


@dataclasses.dataclass(kw_only=True)
class Checkpoint:
    """``[checkpoint]``: where the run lives and how it is saved and resumed."""

    run_dir: Annotated[Path, alias("--run-dir")] = Path("runs/wide_deep")
    """Where the run's checkpoints, config, metrics and plots go (one run per directory)."""
    format: Annotated[CheckpointFormat | None, alias("--checkpoint-format")] = None
    """Integrated (default): one file written by rank 0; sharded (the default with a parameter
    server): each rank its part (torch.distributed.checkpoint)."""
    every: Annotated[int, alias("--checkpoint-every"), Bounds(low=0)] = 0
    """Steps between checkpoints (0: each epoch)."""
    keep_best: Annotated[bool, alias("--keep-best")] = True
    """Keep the best epoch's checkpoint (best.pt, by validation AUC) and score the test split with it."""
    resume: Annotated[Resume | None, alias("--resume")] = None
    """Continue from the run directory's checkpoint; auto: if it exists (not recorded)."""
    overwrite: Annotated[bool, alias("--overwrite")] = False
    """Start a new run where another run's files are: they are removed once the checks pass (not recorded)."""


@dataclasses.dataclass(kw_only=True)
class Parallelism:
    """``[parallelism]``: the parallel dimensions (see ``hetero.parallel.dims.ParallelDims``)."""

    pp: Annotated[int, alias("--pp"), Bounds(low=1)] = 1
    """Pipeline stages, one per rank."""
    schedule: Annotated[Schedule, alias("--schedule")] = Schedule.ONE_F_ONE_B
    """Pipeline schedule (with pp > 1)."""
    micro_batches: Annotated[int | None, alias("--micro-batches"), Bounds(low=1)] = None
    """Micro-batches per batch (with pp > 1; default: pp)."""
    tp: Annotated[int, alias("--tp"), Bounds(low=1)] = 1
    """Operator-parallel ranks for the deep MLP."""
    zero: Annotated[int, alias("--zero"), Bounds(low=0, below=4)] = 0
    """ZeRO stage of the dense part over the data-parallel ranks: 1 Adam states, 2 + gradients, 3 + parameters."""
    table_sharding: Annotated[TableSharding, alias("--table-sharding")] = TableSharding.REPLICATED
    """Host tables whole on every rank, or a 1/N block of rows per rank."""


@dataclasses.dataclass(kw_only=True)
class ParameterServer:
    """``[parameter_server]``: under torchrun the last ``servers`` processes serve the tables."""

    servers: Annotated[int, alias("--ps-servers"), Bounds(low=0)] = 0
    """Server processes (0: no parameter server)."""
    mode: Annotated[PSMode, alias("--ps-mode")] = PSMode.SYNC
    """Sync: one process on the global batch; async: pushes applied on arrival; bounded: async
    with a row cache of at most staleness steps."""
    staleness: Annotated[int, alias("--ps-staleness"), Bounds(low=0)] = 0
    """Bounded mode: steps a pulled row may be reused."""
    server_memory_mb: Annotated[float, alias("--ps-server-memory-mb"), Bounds(low=0.0)] = 0.0
    """Each server's budget for its rows and optimizer state (0: unlimited)."""
    timeout: Annotated[float, alias("--ps-timeout"), Bounds(low=0.0, inclusive=False)] = 60.0
    """Seconds a worker waits for a server's answer."""


@dataclasses.dataclass(kw_only=True)
class Planning:
    """``[planner]``: ``hetero train --plan`` and ``hetero plan``."""

    plan: Annotated[str | None, alias("--plan")] = None
    """Auto: plan the job for this machine and world size; or a plan file from `hetero plan`."""
    device_memory: Annotated[int | None, alias("--device-memory"), BYTES, Bounds(low=1)] = None
    """Device budget per rank (e.g. 2GiB; default: unlimited)."""
    host_memory: Annotated[int | None, alias("--host-memory"), BYTES, Bounds(low=1)] = None
    """Host budget per rank (default: unlimited)."""
    world_size: Annotated[int, alias("--world-size"), Bounds(low=1)] = 1
    """Hetero plan: the ranks the job will run on."""
    out: Annotated[Path, alias("--out")] = Path("plan.json")
    """Hetero plan: the plan file to write."""


@dataclasses.dataclass(kw_only=True)
class Logging:
    """``[logging]``: what a run shows and writes besides its checkpoints."""

    progress: Annotated[bool, alias("--progress")] = True
    """A progress bar (the old --no-progress turns it off)."""
    tensorboard: Annotated[bool, alias("--tensorboard")] = True
    """TensorBoard scalars under RUN_DIR/tensorboard."""


class TableStorage(enum.Enum):
    """Where the host tables' rows and optimizer state live (``hetero.placement.StorageTier``)."""

    MEMORY = "memory"  # host DRAM
    SSD = "ssd"  # a local disk under a DRAM row cache (hetero.storage)
    AUTO = "auto"  # the planner's choice per table (--plan auto): the SSD tier where host memory binds


@dataclasses.dataclass(kw_only=True)
class Tables:
    """``[tables]``: where the host tables live."""

    storage: Annotated[TableStorage, alias("--table-storage")] = TableStorage.MEMORY
    """Host memory, or the SSD tier: each row with its optimizer state in a file on a local disk, under a DRAM
    row cache (replicated or row-sharded tables, with or without prefetch); auto: the planner puts tables there
    where planner.host_memory binds (with --plan auto)."""
    ssd_path: Annotated[Path | None, alias("--ssd-path")] = None
    """Directory of the SSD tier's row files (scratch of one run; default: RUN_DIR/ssd)."""
    cache_mb: Annotated[float, alias("--cache-mb"), Bounds(low=0, inclusive=False)] = 256
    """DRAM budget of each table group's row cache, MiB (rows with their optimizer state)."""
    cache_policy: Annotated[CachePolicy, alias("--cache-policy")] = CachePolicy.LFU
    """The row cache's replacement: lfu (GCLOCK hit counts, TinyLFU's admission) or lru (CLOCK)."""
    mapped_mb: Annotated[float, alias("--mapped-mb"), Bounds(low=0, inclusive=False)] = 1024
    """Of each table group's row file, the MiB kept mapped and read by copying (the rest read with a pread a
    record): faster where the file sits in the page cache; the mapped pages count in the resident set."""


@dataclasses.dataclass(kw_only=True)
class JobConfig:
    """hetero train (and hetero plan): a whole job, from its defaults < a job file (--config) < the command line.
    Every key is --section.key VALUE; the flags before sections (--batch-size, --tp, ...) are
    aliases. docs/job-file.md lists every key."""

    config: Path | None = None
    """A job file (TOML) under the command line: its sections, or [train] with the old flag names."""
    data: Data = dataclasses.field(default_factory=Data)
    schema: tyro.conf.Suppress[Schema | None] = None
    model: Model = dataclasses.field(default_factory=Model)
    tables: Tables = dataclasses.field(default_factory=Tables)
    optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
    training: Training = dataclasses.field(default_factory=Training)
    checkpoint: Checkpoint = dataclasses.field(default_factory=Checkpoint)
    parallelism: Parallelism = dataclasses.field(default_factory=Parallelism)
    parameter_server: ParameterServer = dataclasses.field(default_factory=ParameterServer)
    planner: Planning = dataclasses.field(default_factory=Planning)
    logging: Logging = dataclasses.field(default_factory=Logging)


# the sections a job file may hold, besides [data] and [schema] (read by their own rules) and [train]
SECTIONS = {f.name: f.type for f in dataclasses.fields(JobConfig)
            if f.name not in ("config", "data", "schema")}
