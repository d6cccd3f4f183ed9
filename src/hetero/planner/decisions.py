"""What a plan reports besides its choice: the prediction's parts, each decision's runner-up and
why it lost, and, when nothing fits, the smallest budget that works and what dominates it."""

from __future__ import annotations

from collections.abc import Callable

from hetero.placement import Target
from hetero.planner.cost import MeasuredCost
from hetero.planner.plan import Decision, Prediction, format_bytes
from hetero.planner.search import Assignment, evaluate
from hetero.planner.space import Candidate, CostPart, MemoryPart


def prediction(cost: MeasuredCost, c: Candidate, a: Assignment) -> Prediction:
    fixed = cost.fixed(c)
    parts = dict(fixed.parts)
    crossings, previous = 0.0, None
    for i, choice in enumerate(a.choices):
        u = cost.units[i]
        key = CostPart.HOST_TABLES if u.tables else CostPart.UNITS_WITH_HOST_WEIGHTS \
            if choice.weights is Target.HOST else CostPart.HOST_UNITS if choice.target is Target.HOST \
            else CostPart.DEVICE_UNITS
        parts[key] = parts.get(key, 0.0) + cost.unit(i, choice, c).seconds
        crossings += cost.boundary(i, previous, choice, c).seconds
        previous = choice
    crossings += cost.boundary(len(a.choices), previous, None, c).seconds
    parts[CostPart.CROSSINGS] = crossings
    return Prediction(a.seconds, a.device_bytes, a.host_bytes, parts)


def global_decisions(best_c: Candidate, best: Assignment,
                      results: list[tuple[Candidate, Assignment | None]]) -> list[Decision]:
    out = []
    chosen = best_c.describe()
    for what, value in chosen.items():
        others = [(c, a) for c, a in results if c.describe()[what] != value]
        if not others:
            out.append(Decision(what, value, best.seconds, best.device_bytes))
            continue
        fitting = [(c, a) for c, a in others if a is not None]
        if fitting:
            c, a = min(fitting, key=lambda ca: ca[1].seconds)
            out.append(Decision(what, value, best.seconds, best.device_bytes, c.describe()[what], a.seconds,
                                a.device_bytes, _why(a.seconds, best.seconds)))
        else:
            out.append(Decision(what, value, best.seconds, best.device_bytes, others[0][0].describe()[what],
                                why="no assignment of it fits the budgets"))
    return out


def unit_decisions(cost: MeasuredCost, c: Candidate, best: Assignment, device: float, host: float) -> list[Decision]:
    """Each unit's decision and its runner-up: the plan with that unit's best other option,
    every other decision as planned (over a budget: said so)."""
    out = []
    for i, (name, choice) in enumerate(zip(cost.names(), best.choices)):
        u = cost.unit(i, choice, c)
        others = [o for o in cost.options(i, c) if o != choice]
        if not others:
            why = "host tables: none may move to the device (one data-parallel rank; float32, LazyAdam, Adagrad " \
                "or SGD)" if cost.units[i].tables else "pinned by an annotation" if name in cost.pinned else \
                "its one option: " + ", ".join(r for r, on in (
                    ("nothing of its own to recompute", not cost.units[i].saved_bytes),
                    ("the partitioner cannot trace the model, so no unit goes to the host", not cost.host_units)) if on)
            out.append(Decision(f"unit {name}", f"{choice} ({why})", u.seconds, u.device_static + u.device_kept))
            continue
        alts = [evaluate(cost, c, best.choices[:i] + (o,) + best.choices[i + 1:]) for o in others]
        fitting = [a for a in alts if a.device_bytes <= device and a.host_bytes <= host]
        if fitting:
            alt = min(fitting, key=lambda a: a.seconds)
            out.append(Decision(f"unit {name}", str(choice), u.seconds, u.device_static + u.device_kept,
                                str(alt.choices[i]), alt.seconds, alt.device_bytes, _why(alt.seconds, best.seconds)))
        else:
            alt = min(alts, key=lambda a: a.device_bytes)
            over = "device" if alt.device_bytes > device else "host"
            out.append(Decision(f"unit {name}", str(choice), u.seconds, u.device_static + u.device_kept,
                                str(alt.choices[i]), alt.seconds, alt.device_bytes, f"over the {over} budget"))
    return out


def _why(runner_up: float, chosen: float) -> str:
    return "slower" if runner_up >= chosen else "within the tolerance of it: the plan that changes less wins"


def no_plan_message(cost: MeasuredCost, settings: list[Candidate], search: Callable, device: float, host: float,
             margin: float) -> str:
    """The error text: the smallest device (or host) budget that works and what dominates it
    (``device``: the budget planned to, ``margin`` under the user's; both said as the user's)."""
    def fits(budget_device: float, budget_host: float) -> tuple[Candidate, Assignment] | None:
        found = [(c, search(cost, c, budget_device, budget_host)) for c in settings]
        found = [(c, a) for c, a in found if a is not None]
        return min(found, key=lambda ca: ca[1].device_bytes) if found else None

    if fits(float("inf"), host) is None:
        least = fits(float("inf"), float("inf"))
        need = min(a.host_bytes for _, a in [least]) if least else 0
        return (f"no plan fits the host budget of {format_bytes(host)}: the smallest that works is "
                f"{format_bytes(need)} (host tables, their optimizer state and offloaded optimizer state dominate)")
    low, high = 0.0, fits(float("inf"), host)[1].device_bytes
    while high - low > max(1.0, high * 1e-3):  # the smallest device budget that some plan meets
        mid = (low + high) / 2
        if fits(mid, host) is None:
            low = mid
        else:
            high = mid
    c, a = fits(high, host)
    return (f"no plan fits the device budget of {format_bytes(device / (1 - margin))}; the smallest that works is "
            f"{format_bytes(high / (1 - margin))} ({dominant(cost, c, a)})")


def dominant(cost: MeasuredCost, c: Candidate, a: Assignment) -> str:
    fixed = cost.fixed(c)
    costs = [cost.unit(i, ch, c) for i, ch in enumerate(a.choices)]
    static = sum(u.device_static for u in costs)
    parts = {MemoryPart.UNIT_STATE: static, MemoryPart.BATCH_AND_ROOT: fixed.device_bytes,
             MemoryPart.ACTIVATIONS: a.device_bytes - static - fixed.device_bytes}
    what, nbytes = max(parts.items(), key=lambda kv: kv[1])
    detail = ""
    if what is MemoryPart.UNIT_STATE:
        i = max(range(len(costs)), key=lambda i: costs[i].device_static)
        detail = f"; the largest: unit {cost.names()[i]!r}, {format_bytes(costs[i].device_static)}"
    return f"dominated by {what.value}: {format_bytes(nbytes)}{detail}, with the optimizer state on the " \
           f"{c.describe()['optimizer state']} and {c.micro_batches} micro-batch(es)"
