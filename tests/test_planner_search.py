"""The planner's search against brute force: on random synthetic cost models, the dynamic program
and the ILP return the best assignment within the budgets (or none when none fits)."""

import dataclasses
import random

import pytest

from hetero.placement import Target
from hetero.planner.cost_types import BoundaryCost, FixedCost, UnitCost
from hetero.planner.search import brute_force, dynamic_programming, evaluate, ilp
from hetero.planner.space import UNIT_CHOICES, Candidate


@dataclasses.dataclass
class Synthetic:
    """A CostModel of random numbers: per unit and option a UnitCost; per boundary, seconds
    when its sides' targets differ and kept bytes that depend on both sides' options."""

    costs: list[dict]
    crossings: list[float]
    fixed_cost: FixedCost
    kept: dict = dataclasses.field(default_factory=dict)
    pins: dict[int, Target] = dataclasses.field(default_factory=dict)

    def names(self):
        return [f"u{i}" for i in range(len(self.costs))]

    def options(self, i, candidate):
        return tuple(c for c in self.costs[i] if i not in self.pins or c.target is self.pins[i])

    def unit(self, i, choice, candidate):
        return self.costs[i][choice]

    def boundary(self, i, before, after, candidate):
        targets = [c.target if c is not None else Target.DEVICE for c in (before, after)]
        seconds = self.crossings[i] if targets[0] is not targets[1] else 0.0
        kept, during = self.kept.get((i, before, after), (0, 0))
        return BoundaryCost(seconds, kept, during)

    def fixed(self, candidate):
        return self.fixed_cost


def synthetic(rng, n):
    costs = []
    for _ in range(n):
        act, saved, params = rng.randint(1, 50), rng.randint(0, 80), rng.randint(0, 60)
        device, host = rng.uniform(0, 1), rng.uniform(0, 3)  # their optimizer updates (a pipeline does not pace them)
        costs.append({
            UNIT_CHOICES[0]: UnitCost(device + rng.uniform(1, 3), params, act + saved, act + saved + rng.randint(0, 20), 0, device),
            UNIT_CHOICES[1]: UnitCost(device + rng.uniform(1.5, 4), params, act, act + saved + rng.randint(0, 20), 0, device),
            UNIT_CHOICES[2]: UnitCost(host + rng.uniform(2, 9), 0, 0, 0, params * 2 + act + saved, host),
        })
    kept = {}
    for i in range(n + 1):
        for before in ((None,) if i == 0 else UNIT_CHOICES):
            for after in ((None,) if i == n else UNIT_CHOICES):
                kept[i, before, after] = rng.randint(0, 25), rng.randint(0, 40)
    return Synthetic(costs, [rng.uniform(0, 2) for _ in range(n + 1)], FixedCost({"x": 1.0}, rng.randint(0, 30), 5, rng.randint(0, 40)),
                     kept)


@pytest.mark.parametrize("seed", range(40))
def test_dynamic_programming_and_ilp_find_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    model = synthetic(rng, rng.randint(1, 7))
    everything = evaluate(model, Candidate(), [UNIT_CHOICES[0]] * len(model.costs)).device_bytes
    for fraction in (1.5, 0.6, 0.3, 0.1):  # from "everything fits" down to "little fits"
        device, host = everything * fraction, rng.choice([float("inf"), 400.0])
        want = brute_force(model, Candidate(), device, host)
        for search in (dynamic_programming, ilp):
            got = search(model, Candidate(), device, host)
            if want is None:
                assert got is None, (search.__name__, fraction)
                continue
            assert got is not None, (search.__name__, fraction)
            assert got.seconds == pytest.approx(want.seconds, rel=1e-9), (search.__name__, fraction)
            assert got.device_bytes <= device and got.host_bytes <= host
            again = evaluate(model, Candidate(), got.choices)  # what it reports is what the rule says
            assert (again.device_bytes, again.host_bytes) == (got.device_bytes, got.host_bytes)
            assert again.seconds == pytest.approx(got.seconds, rel=1e-12)


def test_the_search_keeps_a_pinned_target():
    rng = random.Random(3)
    model = synthetic(rng, 5)
    model.pins = {1: Target.HOST, 3: Target.DEVICE}
    for search in (brute_force, dynamic_programming, ilp):
        got = search(model, Candidate(), float("inf"), float("inf"))
        assert got.choices[1].target is Target.HOST and got.choices[3].target is Target.DEVICE


def test_a_frontier_thinned_by_rounding_stays_within_the_budget():
    rng = random.Random(7)
    model = synthetic(rng, 14)
    everything = evaluate(model, Candidate(), [UNIT_CHOICES[0]] * 14).device_bytes
    exact = ilp(model, Candidate(), everything * 0.3, float("inf"))
    thinned = dynamic_programming(model, Candidate(), everything * 0.3, float("inf"), max_labels=5, resolution=50)
    assert thinned.device_bytes <= everything * 0.3
    assert thinned.seconds <= exact.seconds * 1.2  # near the optimum (exact: test above)


@pytest.mark.parametrize("seed", range(30))
def test_the_stage_split_by_dynamic_programming_is_the_brute_force_optimum(seed):
    from hetero.planner.pipeline import brute_force_stages, search_stages, stage_cost

    rng = random.Random(seed)
    n = rng.randint(2, 7)  # (the reference tries every option of every unit of each stage)
    model = synthetic(rng, n)
    cuts = sorted(rng.sample(range(1, n), rng.randint(1, n - 1)))  # where a stage may begin
    pp = rng.randint(2, min(4, len(cuts) + 1))
    c = Candidate(pp=pp, micro_batches=rng.choice([pp, 2 * pp]))
    sends, reduces = [rng.uniform(0, 0.5) for _ in range(n)], [rng.uniform(0, 0.3) for _ in range(n)]

    def reduce(lo, hi):  # a stage's gradient all-reduce over its replicas
        return sum(reduces[lo:hi])

    whole = stage_cost(model, c, 0, n, 0, [UNIT_CHOICES[0]] * n, sends.__getitem__).device_bytes
    for fraction in (2.0, 0.6, 0.35, 0.2, 0.05):  # each stage's units on the device, recomputing or on the host
        device, host = whole * fraction, rng.choice([float("inf"), 300.0])
        want = brute_force_stages(model, c, cuts, device, host, sends.__getitem__, reduce)
        got = search_stages(model, c, cuts, device, host, sends.__getitem__, reduce)
        if want is None:
            assert got is None, fraction
            continue
        assert got is not None and got.seconds == pytest.approx(want.seconds, rel=1e-12), fraction
        assert set(got.cuts) <= set(cuts) and len(got.cuts) == pp - 1 and got.device_bytes <= device
        assert got.host_bytes <= host
        assert got.seconds == pytest.approx(max(got.stage_seconds))
