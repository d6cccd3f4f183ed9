"""The plan: one value that says what a run does (see ``shared/design/parallel.md``), its file
and its report.

A :class:`Plan` holds the mesh and the model-wide decisions (:class:`~hetero.planner.space.Candidate`),
each unit's decision, the user's annotations it kept, the predicted step time and peaks, and for
every decision what it beat (:class:`Decision`). ``plan.save(path)`` writes the strategy file of
the operator-parallel mechanism (:func:`hetero.parallel.save_strategy`: ``mesh`` and ``layout``,
the placements of every sharded parameter) with the plan under ``"plan"``; :meth:`Plan.load`
reads it back, checking every field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from hetero.embedding import HostEmbedding, host_tables
from hetero.placement import PlacementSpec, StorageTier, Target
from hetero.parallel.operator_plan import OpStrategy, ShardingPlan
from hetero.parallel.recompute import RecomputeConfig
from hetero.planner.graph import Granularity
from hetero.planner.space import Candidate, CostPart, OptimizerKind, StateHome, TablePlacement, UnitChoice
from hetero.planner.table_plan import TablePlan
from hetero.storage import CachePolicy, SsdConfig

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the cost model predicts of a step.

    Attributes:
        seconds: the step time; ``parts``: seconds by part (they add up to it).
        device_bytes, host_bytes: the peaks.
    """

    seconds: float
    device_bytes: int
    host_bytes: int
    parts: dict[CostPart, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Decision:
    """One decision and the best alternative it beat.

    Attributes:
        what: the decision (``"unit blocks.0"``, ``"optimizer state"``, ``"micro-batches"``...).
        chosen: the chosen value in words; ``seconds``, ``device_bytes``: the plan's prediction
            with it (for a unit: the unit's own seconds and device bytes).
        runner_up: the best other value (``""``: there was no other), with the whole plan's
            predicted seconds and device peak (for a unit: the plan with only that unit changed),
            and why it lost (``"slower"``, ``"over the device budget"``).
    """

    what: str
    chosen: str
    seconds: float
    device_bytes: int
    runner_up: str = ""
    runner_up_seconds: float | None = None
    runner_up_device_bytes: int | None = None
    why: str = ""


@dataclasses.dataclass(frozen=True)
class SearchReport:
    """How the plan was found: the per-unit search's method, the candidates of the outer
    enumeration, those searched (the others' lower bound lost: branch and bound) and feasible
    of them, and the seconds of capture, calibration and search."""

    method: str
    candidates: int
    feasible: int
    capture_seconds: float
    calibration_seconds: float
    search_seconds: float
    searched: int = 0


@dataclasses.dataclass
class Plan:
    """Everything a run decides (see the module docstring).

    Attributes:
        model: the model's class name; ``batch``: the global batch it was planned for.
        world_size: ranks; ``device_memory``, ``host_memory``: the budgets (bytes per rank;
            ``None``: unlimited).
        optimizer: the dense optimizer (its math; the plan decides where it runs).
        candidate: the mesh and model-wide decisions.
        units: each unit's decision, by qualified name, in model order.
        annotations: the user's pinned targets the plan kept, by unit.
        predicted: the chosen plan's prediction.
        decisions: every decision with its runner-up.
        search: how it was found.
        machine: the calibrated machine, in words; ``host_is_device``: it has no accelerator
            (the device part runs on the host's cores, and the plan says so).
        sharding: with ``tp > 1``, every ``nn.Linear``'s operator strategy by qualified name;
            ``layout``: the sharded parameters' placements over ``(pp, dp, tp)``;
            ``kept_sharding``: the modules whose strategy is the user's annotation.
        device_tables: the tables the plan moves to the device, by qualified name (the rest
            stay host tables).
        split_points: with ``pp > 1``, the pipeline units where stages ``1..pp-1`` begin
            (:class:`~hetero.parallel.pipeline_plan.PipelineConfig`'s).
        granularity: what one of ``units`` is (blocks, or leaf modules: per-op placement).
        ssd_tables: the tables the plan puts on the SSD tier (``ssd``: its settings), by qualified name;
            ``ssd_hit_rate``: the expected row hit rate of their caches (of the distinct rows a
            step touches; :meth:`hetero.planner.table_cost.TablePricing.ssd_cost`).
    """

    model: str
    batch: int
    world_size: int
    device_memory: int | None
    host_memory: int | None
    optimizer: OptimizerKind
    candidate: Candidate
    units: dict[str, UnitChoice]
    annotations: dict[str, Target]
    predicted: Prediction
    decisions: list[Decision]
    search: SearchReport
    machine: str
    host_is_device: bool
    sharding: dict[str, OpStrategy] = dataclasses.field(default_factory=dict)
    layout: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    kept_sharding: tuple[str, ...] = ()
    device_tables: tuple[str, ...] = ()
    split_points: tuple[str, ...] = ()
    granularity: Granularity = Granularity.BLOCKS
    ssd_tables: tuple[str, ...] = ()
    ssd_hit_rate: float | None = None
    ssd: SsdConfig | None = None

    # ---------------------------------------------------------------- what it asks of a model
    def host_units(self) -> list[str]:
        """The units placed on the host (host tables included)."""
        return [name for name, c in self.units.items() if c.target is Target.HOST]

    def table_plans(self, model: nn.Module) -> dict[str, TablePlan]:
        """Where the plan puts each host table of ``model`` (by qualified name), as the one typed
        value (:class:`~hetero.planner.table_plan.TablePlan`): the device, the SSD tier (the plan's
        ``ssd``) or host memory; replicated or row-sharded over the plan's data-parallel ranks; the
        table's own keys. ``hetero.apply`` makes it real."""
        out = {}
        distribution = TablePlacement.ROW_SHARDED if self.candidate.tables is TablePlacement.ROW_SHARDED \
            else TablePlacement.REPLICATED  # (one process's tables: the degenerate replica)
        for name, table in host_tables(model).items():
            now = TablePlan.of(table)
            memory = StorageTier.DEVICE_MEMORY if name in self.device_tables else \
                StorageTier.SSD if name in self.ssd_tables else StorageTier.HOST_DRAM
            out[name] = dataclasses.replace(now, memory=memory, ssd=self.ssd if memory is StorageTier.SSD else None,
                                            distribution=distribution)
        return out

    def streamed_units(self) -> list[str]:
        """The device units whose parameters live on the host (streamed to the device each pass)."""
        return [name for name, c in self.units.items() if c.weights is Target.HOST]

    def placement_spec(self, model: nn.Module, partial: bool = False) -> PlacementSpec:
        """The plan's host/device placement of ``model`` as a :class:`~hetero.placement.PlacementSpec`:
        its host units (host tables place themselves) and the parameters of its units whose
        weights are streamed. ``partial``: ``model`` holds some of the units (a pipeline stage,
        names unchanged); the spec places those.

        Raises:
            ValueError: a unit ``model`` does not have (another model's plan), naming it.
        """
        modules = dict(model.named_modules())
        missing = [n for n in self.host_units() + self.streamed_units() if n not in modules]
        if partial:
            return self._placement(model, [n for n in self.host_units() if n in modules],
                                   [n for n in self.streamed_units() if n in modules])
        if missing:
            raise ValueError(f"the plan places units {missing}, which {type(model).__name__} does not have: plan this "
                             f"model (hetero.plan)")
        return self._placement(model, self.host_units(), self.streamed_units())

    @staticmethod
    def _placement(model: nn.Module, hosted: list[str], streamed: list[str]) -> PlacementSpec:
        spec = PlacementSpec()
        for name in hosted:
            if not any(isinstance(m, HostEmbedding) for m in model.get_submodule(name).modules()):
                spec.module(name, Target.HOST)
        for name in streamed:
            for param, _ in model.get_submodule(name).named_parameters(prefix=name):
                spec.param(param, Target.HOST)
        return spec

    def sharding_plan(self) -> ShardingPlan | None:
        """The plan's operator strategies as a :class:`~hetero.parallel.ShardingPlan` (``None``:
        no ``tp``)."""
        if not self.sharding:
            return None
        out = ShardingPlan()
        for name, s in self.sharding.items():
            out.module(name, s.in_strategy, s.out_strategy, s.use_local_output)
        return out

    def recompute_config(self) -> RecomputeConfig:
        """The units that recompute their activations."""
        return RecomputeConfig(tuple(name for name, c in self.units.items() if c.recompute))

    # ---------------------------------------------------------------- file
    def to_dict(self) -> dict[str, Any]:
        c = self.candidate
        return {
            "format_version": FORMAT_VERSION, "model": self.model, "batch": self.batch, "world_size": self.world_size,
            "device_memory": self.device_memory, "host_memory": self.host_memory, "optimizer": self.optimizer.value,
            "candidate": {**dataclasses.asdict(c), "state": c.state.value, "tables": c.tables.value},
            "units": {k: {"target": v.target.value, "recompute": v.recompute, "device_tables": v.device_tables,
                          "weights": v.weights.value, "ssd_tables": v.ssd_tables} for k, v in self.units.items()},
            "annotations": {k: v.value for k, v in self.annotations.items()},
            "predicted": {**dataclasses.asdict(self.predicted),
                          "parts": {k.value: v for k, v in self.predicted.parts.items()}},
            "decisions": [dataclasses.asdict(d) for d in self.decisions],
            "search": dataclasses.asdict(self.search), "machine": self.machine, "host_is_device": self.host_is_device,
            "sharding": {k: {"in": [list(x) for x in v.in_strategy], "out": None if v.out_strategy is None else
                             list(v.out_strategy), "local_output": v.use_local_output} for k, v in self.sharding.items()},
            "kept_sharding": list(self.kept_sharding), "device_tables": list(self.device_tables),
            "split_points": list(self.split_points), "granularity": self.granularity.value,
            "ssd_tables": list(self.ssd_tables), "ssd_hit_rate": self.ssd_hit_rate,
            "ssd": None if self.ssd is None else {"directory": str(self.ssd.directory), "cache_bytes": self.ssd.cache_bytes,
                                                  "policy": self.ssd.policy.value, "io_threads": self.ssd.io_threads},
        }

    @staticmethod
    def from_dict(doc: dict[str, Any], where: str = "plan", layout: dict[str, list[str]] | None = None) -> "Plan":
        """Raises: ValueError: another format version or a field that does not parse (naming it)."""
        if doc.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{where}: plan format {doc.get('format_version')!r}; this hetero reads {FORMAT_VERSION}")
        try:
            cand = dict(doc["candidate"])
            cand["state"], cand["tables"] = StateHome(cand["state"]), TablePlacement(cand["tables"])
            return Plan(doc["model"], doc["batch"], doc["world_size"], doc["device_memory"], doc["host_memory"],
                        OptimizerKind(doc["optimizer"]), Candidate(**cand),
                        {k: UnitChoice(Target(v["target"]), v["recompute"], v.get("device_tables", 0),
                                       Target(v.get("weights", "device")), v.get("ssd_tables", 0))
                         for k, v in doc["units"].items()},
                        {k: Target(v) for k, v in doc["annotations"].items()}, _prediction(doc["predicted"]),
                        [Decision(**d) for d in doc["decisions"]], SearchReport(**doc["search"]), doc["machine"],
                        doc["host_is_device"],
                        {k: OpStrategy(tuple(tuple(x) for x in v["in"]), None if v["out"] is None else tuple(v["out"]),
                                       v["local_output"]) for k, v in doc.get("sharding", {}).items()},
                        dict(layout or {}), tuple(doc.get("kept_sharding", ())), tuple(doc.get("device_tables", ())),
                        tuple(doc.get("split_points", ())), Granularity(doc.get("granularity", "blocks")),
                        tuple(doc.get("ssd_tables", ())), doc.get("ssd_hit_rate"),
                        None if doc.get("ssd") is None else SsdConfig(**{**doc["ssd"],
                                                                         "policy": CachePolicy(doc["ssd"]["policy"])}))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a hetero plan ({type(e).__name__}: {e})") from None

    def save(self, path: str | Path) -> Path:
        """Write the strategy file (``mesh``, ``layout``) with the plan under ``"plan"``,
        atomically (a temporary file renamed into place)."""
        path = Path(path)
        c = self.candidate
        doc = {"mesh": {"shape": [c.pp, c.dp, c.tp], "dim_names": ["pp", "dp", "tp"]}, "layout": dict(sorted(self.layout.items())),
               "plan": self.to_dict()}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @staticmethod
    def load(path: str | Path) -> "Plan":
        """Read a plan file :meth:`save` wrote.

        Raises:
            FileNotFoundError: no such file. ValueError: not a plan file (naming it).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"plan file {path} does not exist")
        try:
            doc = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if "plan" not in doc:
            raise ValueError(f"{path} is a strategy file without a plan: write one with hetero.plan(...).save(path)")
        return Plan.from_dict(doc["plan"], str(path), doc.get("layout"))

    # ---------------------------------------------------------------- report
    def __str__(self) -> str:
        def mb(b: float | None) -> str:
            return "unlimited" if b is None else format_bytes(b)

        p = self.predicted
        lines = [f"plan for {self.model}: batch {self.batch}, {self.world_size} rank(s); budgets: device "
                 f"{mb(self.device_memory)}, host {mb(self.host_memory)} per rank",
                 f"machine: {self.machine}" + ("; no accelerator: the device part runs on the host's cores, "
                                               "calibrated as such" if self.host_is_device else ""),
                 f"predicted step {p.seconds * 1e3:.2f} ms; device peak {mb(p.device_bytes)}, host {mb(p.host_bytes)}",
                 "  " + ", ".join(f"{k.value} {v * 1e3:.2f} ms" for k, v in p.parts.items() if v),
                 f"search: {self.search.method}, {self.search.searched} of {self.search.candidates} settings searched "
                 f"(the others' bound lost), {self.search.feasible} of them fit; "
                 f"capture {self.search.capture_seconds:.2f} s, calibration {self.search.calibration_seconds:.2f} s "
                 f"(cached), search {self.search.search_seconds:.2f} s",
                 f"optimizer: {self.optimizer.value}"]
        if self.annotations:
            lines.append("kept annotations: " + ", ".join(f"{k} on {v.value}" for k, v in self.annotations.items()))
        if self.sharding:
            lines.append(f"operator strategies (tp {self.candidate.tp}; input (..., in) and weight (in, out) slices):")
            lines += [f"  {k}: {v.in_strategy}" + (" (kept annotation)" if k in self.kept_sharding else "") +
                      (", output made whole" if v.use_local_output else "") for k, v in self.sharding.items()]
        if self.device_tables:
            lines.append("tables on the device: " + ", ".join(self.device_tables))
        if self.ssd_tables:
            lines.append("tables on the SSD tier: " + ", ".join(self.ssd_tables) + f" ({self.ssd.directory}, a row cache "
                         f"of {mb(self.ssd.cache_bytes)} per group; expected row hit rate {self.ssd_hit_rate:.0%})")
        if self.split_points:
            lines.append(f"pipeline: {self.candidate.pp} stages (1F1B, {self.candidate.micro_batches} micro-batches), "
                         f"stages 1.. begin at " + ", ".join(self.split_points))
        lines.append("decisions (predicted step and device peak with it; the runner-up it beat):")
        for d in self.decisions:
            line = f"  {d.what}: {d.chosen} ({d.seconds * 1e3:.2f} ms, {mb(d.device_bytes)})"
            if d.runner_up:
                alt = f"{d.runner_up_seconds * 1e3:.2f} ms, {mb(d.runner_up_device_bytes)}" \
                    if d.runner_up_seconds is not None else d.why
                line += f"; runner-up {d.runner_up} ({alt}{'; ' + d.why if d.why and d.runner_up_seconds else ''})"
            lines.append(line)
        return "\n".join(lines)


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that leaves at least 1 of it (``"1.5 KiB"``,
    ``"12.0 MiB"``), so a small budget does not read as ``0.0 MiB``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(nbytes) >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes:.0f} B"


def _prediction(doc: dict[str, Any]) -> Prediction:
    """A plan file's prediction (its parts by their names)."""
    return Prediction(**{**doc, "parts": {CostPart(k): v for k, v in doc.get("parts", {}).items()}})
