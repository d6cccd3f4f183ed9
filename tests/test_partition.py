"""Op-level placement and host/device partitioning against the unplaced model."""

import itertools
import threading
import time

import pytest
import torch
from torch import nn

import hetero
from conftest import assert_parity
from hetero.embedding import HostEmbedding, Pooling, TableConfig
from hetero.placement import PlacementSpec, Target, on, partition, place


class Dense(nn.Module):
    """The seed's Dense: weight in [in, out] layout, an explicit matmul and add."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(i, o) * 0.3)
        self.bias = nn.Parameter(torch.randn(o) * 0.1)

    def forward(self, x):
        return x @ self.weight + self.bias


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = Dense(6, 8), Dense(8, 8), Dense(8, 3)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class TwoBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = Dense(6, 5), Dense(6, 5), Dense(10, 2)

    def forward(self, x):
        return self.head(torch.cat([torch.tanh(self.a(x)), torch.sigmoid(self.b(x))], dim=1))


class WithEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = HostEmbedding(TableConfig("e", 30, 6, pooling=Pooling.MEAN, init_std=0.5))
        self.mlp, self.out = Dense(6 + 6, 8), Dense(8, 1)

    def forward(self, x, ids, offsets):
        return self.out(torch.relu(self.mlp(torch.cat([self.emb(ids, offsets), x], dim=1))))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner1, self.inner2 = Dense(6, 6), Dense(6, 6)

    def forward(self, x):
        with on(Target.HOST):  # a region inside forward
            h = torch.relu(self.inner1(x))
        return x + self.inner2(h)


def _inputs(model):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, generator=g)
    if isinstance(model, WithEmbedding):
        return x, torch.randint(0, 30, (9,), generator=g), torch.tensor([0, 2, 2, 7, 9])
    return (x,)


def _run(model, inputs):
    out = model(*inputs)
    (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for t in [m for m in model.modules() if isinstance(m, HostEmbedding)]:
        g = t.pop_sparse_grad()
        grads[t.name] = torch.zeros_like(t.weight).index_put_((g.ids,), g.rows)
    return out.detach(), grads


def _assignments(model):
    """Every host/device assignment of the model's children, and of each op type on its own."""
    children = [n for n, _ in model.named_children()]
    for combo in itertools.product([Target.HOST, Target.DEVICE], repeat=len(children)):
        spec = PlacementSpec()
        for name, t in zip(children, combo):
            spec.module(name, t)
        yield spec
    for op in ("matmul", "add", "relu", "cat"):
        yield PlacementSpec().op("", op, Target.HOST)


@pytest.mark.parametrize("make", [MLP, TwoBranch, WithEmbedding, Residual], ids=lambda c: c.__name__)
def test_every_placement_equals_the_unplaced_model(make):
    torch.manual_seed(0)
    reference = make()
    inputs = _inputs(reference)
    ref_out, ref_grads = _run(reference, inputs)
    tried = 0
    for spec in _assignments(reference):
        try:
            spec_ops = {r.op for r in spec.ops}
            torch.manual_seed(0)
            hm = partition(make(), spec)
        except ValueError as e:  # an op type this model does not run
            assert "which runs no such op" in str(e) and spec_ops
            continue
        out, grads = _run(hm, inputs)
        assert_parity(out, ref_out)
        assert grads.keys() == ref_grads.keys()
        for k in grads:
            assert_parity(grads[k], ref_grads[k], k)
        tried += 1
    assert tried >= 4


def test_explain_reports_the_subgraphs_bytes_and_concurrency():
    torch.manual_seed(0)
    spec = PlacementSpec().op("fc1", "matmul", "host").op("fc1", "add", "host").module("fc3", "host")
    report = hetero.explain(MLP(), (torch.randn(4, 6),), spec)
    assert [(s.target, s.ops) for s in report.subgraphs] == [
        (Target.HOST, [("matmul", "fc1"), ("add", "fc1")]),
        (Target.DEVICE, [("relu", ""), ("matmul", "fc2"), ("add", "fc2"), ("relu", "")]),
        (Target.HOST, [("matmul", "fc3"), ("add", "fc3")]),
    ]
    assert report.param_bytes == {Target.HOST: (6 * 8 + 8 + 8 * 3 + 3) * 4, Target.DEVICE: (8 * 8 + 8) * 4}
    assert report.h2d_bytes == 4 * 8 * 4 and report.d2h_bytes == (4 * 6 + 4 * 8) * 4  # x enters on the host
    assert report.concurrent == []
    two = hetero.explain(TwoBranch(), (torch.randn(4, 6),), PlacementSpec().module("a", "host"))
    assert len(two.concurrent) == 1 and "may run concurrently: submod_" in str(two)


events = {}


@torch.fx.wrap
def slow(x, name):
    events[name] = [time.perf_counter(), threading.current_thread().name]
    time.sleep(0.3)
    events[name].append(time.perf_counter())
    return x


class SlowBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Dense(4, 4), Dense(4, 4)

    def forward(self, x):
        with on("host"):
            ha = slow(self.a(x), "host")
        hb = slow(self.b(x), "device")
        return ha + hb


def test_independent_host_and_device_subgraphs_run_concurrently():
    hm = partition(SlowBranches())
    out = hm(torch.ones(2, 4))
    host_start, host_thread, host_end = events["host"]
    dev_start, dev_thread, dev_end = events["device"]
    ref = SlowBranches()  # the eager reference runs the branches one after the other
    ref.load_state_dict(hm.state_dict())
    assert_parity(out, ref(torch.ones(2, 4)))
    assert host_start < dev_end and dev_start < host_end  # the two intervals overlap
    assert host_thread.startswith("hetero-host") and dev_thread == threading.current_thread().name


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = place(Dense(4, 4), "host")

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: no graph can be captured
            return self.fc(x)
        return -x


def test_fallback_to_module_placement_warns_and_stays_exact():
    torch.manual_seed(0)
    model = DataDependent()
    x = torch.ones(2, 4)
    ref = model(x)
    with pytest.warns(UserWarning, match=r"cannot capture the forward graph of DataDependent \(TraceError: symbolically traced"):
        hm = partition(model)
    assert_parity(hm(x), ref)
    assert_parity(hm(-x), x)
    with pytest.warns(UserWarning):
        assert "no graph captured (TraceError" in str(hetero.explain(model, (x,)))


def test_bad_placement_input_names_it_and_lists_choices():
    with pytest.raises(ValueError, match=r"unknown placement target 'gpu0'; valid targets are 'host', 'device'"):
        PlacementSpec().module("fc1", "gpu0")
    with pytest.raises(ValueError) as err:
        partition(MLP(), PlacementSpec().module("fc9", "host"))
    assert str(err.value) == "placement names module 'fc9', which MLP does not have; its modules are ['fc1', 'fc2', 'fc3']"
    with pytest.raises(ValueError) as err:
        partition(MLP(), PlacementSpec().op("fc1", "conv2d", "host"))
    assert str(err.value) == "placement names op type 'conv2d' in module 'fc1', which runs no such op; its op types are ['add', 'matmul']"
    with pytest.raises(ValueError, match="conflicting pins for parameter 'fc1.weight': host and device"):
        PlacementSpec().param("fc1.weight", "host").param("fc1.weight", "device")
    with pytest.raises(ValueError, match="conflicting pin: parameter 'emb.weight' belongs to a host-resident HostEmbedding"):
        partition(WithEmbedding(), PlacementSpec().param("emb.weight", "device"))
    with pytest.raises(ValueError, match=r"pins parameter 'fc1.w', which MLP does not have; its parameters are \['fc1.bias'"):
        partition(MLP(), PlacementSpec().param("fc1.w", "host"))


def test_parameter_pin_overrides_following_its_consumer():
    torch.manual_seed(0)
    ref = MLP()
    ref_out, ref_grads = _run(ref, _inputs(ref))
    torch.manual_seed(0)
    hm = partition(MLP(), PlacementSpec().param("fc2.weight", "host"))  # fc2's matmul stays on the device
    assert hm.param_targets["fc2.weight"] is Target.HOST and hm.param_targets["fc2.bias"] is Target.DEVICE
    out, grads = _run(hm, _inputs(ref))
    assert_parity(out, ref_out)
    for k in ref_grads:
        assert_parity(grads[k], ref_grads[k], k)
    report = hetero.explain(hm, _inputs(ref))
    assert report.param_bytes[Target.HOST] == 8 * 8 * 4 and report.h2d_bytes >= 8 * 8 * 4  # the pinned weight travels
    # A HostEmbedding placed on the device delivers its lookups there; its table stays on the host.
    hm = partition(WithEmbedding(), PlacementSpec().module("emb", "device"))
    assert hm.param_targets["emb.weight"] is Target.HOST and hm.param_targets["mlp.weight"] is Target.DEVICE
    assert hm.model.emb.weight.device.type == "cpu"
    assert hm.model.emb.output_device == hetero.placement.resolve_device(Target.DEVICE)


class Decorated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = Dense(6, 6)

    @hetero.placement.host_ops
    def embed(self, x):
        return torch.tanh(self.fc(x))

    def forward(self, x):
        return torch.relu(self.embed(x)) * 2


def test_function_marker_places_the_ops_of_a_method():
    hm = partition(Decorated())
    assert [(s.target, [k for k, _ in s.ops]) for s in hm.subgraphs] == [
        (Target.HOST, ["matmul", "add", "tanh"]), (Target.DEVICE, ["relu", "mul"])]


class Linears(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_pin_on_a_parameter_of_nn_linear_is_honoured():
    # nn.Linear is a leaf for torch.fx: its pinned weight must still live on the host, travel to
    # its consumer, and get its gradient back, exactly as the unplaced model's.
    torch.manual_seed(0)
    ref = Linears()
    x = torch.randn(5, 8)
    ref(x).square().sum().backward()
    torch.manual_seed(0)
    model = Linears()
    hm = partition(model, PlacementSpec().param("fc2.weight", "host"))
    assert hm.param_targets["fc2.weight"] is Target.HOST and hm.param_targets["fc2.bias"] is Target.DEVICE
    assert hm.param_targets["fc1.weight"] is Target.DEVICE
    out = hm(x)
    out.square().sum().backward()
    assert_parity(out, ref(x))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_parity(p.grad, q.grad, name)
    report = hetero.explain(hm, (x,))
    assert report.param_bytes[Target.HOST] == 4 * 8 * 4  # fc2.weight alone
    assert report.h2d_bytes >= 4 * 8 * 4  # it travels to the op that consumes it
    # The placement page's example: an op rule by the op type of nn.Linear
    hm = partition(Linears(), PlacementSpec().op("fc1", "linear", "host"))
    assert [(s.target, [k for k, _ in s.ops]) for s in hm.subgraphs][0] == (Target.HOST, ["linear"])


def test_a_pin_that_cannot_be_honoured_is_refused():
    model = Linears()
    hetero.placement.place(model.fc2, "device")  # fc2 runs as one op of its own
    with pytest.raises(ValueError, match=r"pins parameter 'fc2.weight' to host, but module 'fc2' \(Linear\) runs as one op"):
        partition(model, PlacementSpec().param("fc2.weight", "host"))


def test_explain_a_model_with_a_host_table_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = WithEmbedding()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, ids, offsets = torch.randn(4, 6), torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 2, 4, 5])
    report = hetero.explain(model, (x, ids, offsets), PlacementSpec().module("mlp", "host"))
    assert report.param_bytes[Target.HOST] >= 30 * 6 * 4  # the table is counted on the host
    assert report.subgraphs and report.fallback_reason is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.emb.group.tables == [model.emb]  # the original's group is untouched


def test_host_subgraphs_on_the_worker_thread_run_under_the_callers_autocast():
    # autocast (like grad mode, the CUDA device and stream) is per thread: the worker that runs
    # host subgraphs must take the caller's, or its matmuls run in fp32.
    torch.manual_seed(0)
    ref = TwoBranch()
    x = _inputs(ref)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(x)
    hm = partition(TwoBranch(), PlacementSpec().module("a", "host"), concurrent=True)
    hm.model.load_state_dict(ref.state_dict())
    assert any(s.target is Target.HOST for s in hm.subgraphs)
    seen = []
    host = next(s.name for s in hm.subgraphs if s.target is Target.HOST)  # branch a: x @ W + b, on the CPU
    hm.split.get_submodule(host).register_forward_hook(lambda m, i, out: seen.append(out))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = hm(x)
        want_a = ref.a(x)
    assert torch.equal(seen[0], want_a)  # the host branch's matmul in bf16 on the worker, as on the caller
    if not torch.cuda.is_available():  # (on a GPU the device branch runs outside any CUDA autocast)
        assert_parity(got, want)  # in fp32 the host branch's values differ


def test_the_documented_placement_example_runs_as_written(capsys):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "placement.md").read_text()
    start = readme.index("```python\nimport torch\nimport hetero\nfrom hetero.placement import PlacementSpec")
    code = readme[start + len("```python\n") : readme.index("```", start + 10)]
    scope = {}
    exec(compile(code, "docs/placement.md", "exec"), scope)  # noqa: S102 - the project's own docs
    report = capsys.readouterr().out
    assert "linear@fc1" in report and "parameters: " in report
    hm = scope["model"]
    assert hm.param_targets["fc2.weight"] is Target.HOST and hm.param_targets["fc1.weight"] is Target.HOST
    assert hm(scope["example_batch"]).shape == (8, 1)


def test_a_module_with_forward_hooks_runs_whole_so_its_hooks_run():
    """torch.fx traces into a module's forward without its hooks: a module with hooks of its own
    (FSDP2's gathers, an operator strategy's layouts, a user's) is kept as one op, so the
    partitioned model computes what the model does."""
    torch.manual_seed(0)
    model = MLP()
    model.fc2.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model.fc2.register_forward_hook(lambda m, args, out: out + 1)
    x = torch.randn(4, 6)
    want = model(x)
    hm = partition(model, PlacementSpec().module("fc1", "host"))
    assert [op for s in hm.subgraphs for op, path in s.ops if path == "fc2"] == ["dense"]  # one op, not traced into
    assert_parity(hm(x), want)
