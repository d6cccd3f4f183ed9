"""DLRM on host tables equals a plain PyTorch DLRM (nn.Embedding + torch's SparseAdam, the
interaction written as explicit pairwise dot products), and trains from a job file."""

import json

import pytest
import torch
from torch import nn

from hetero.cli import main
from hetero.embedding import host_tables
from hetero.models.dlrm import DLRM, DLRMConfig
from hetero.models.wide_deep import FeatureSlot
from hetero.optim import LazyAdam
from tests.test_stream import _job

FEATURES = [FeatureSlot("a", 50), FeatureSlot("b", 30), FeatureSlot("c", 7)]
CONFIG = DLRMConfig(embedding_dim=4, bottom=(8,), top=(16, 8))


class Reference(nn.Module):
    """DLRM as the paper writes it, independently of hetero's module."""

    def __init__(self, model: DLRM):
        super().__init__()
        self.tables = nn.ModuleDict({f.name: nn.Embedding(f.vocab_size, 4, sparse=True) for f in FEATURES})
        for f in FEATURES:
            self.tables[f.name].weight.data.copy_(model.deep.tables[f"deep_{f.name}"].weight.detach())
        self.bottom = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4), nn.ReLU())
        n = 1 + len(FEATURES)
        self.top = nn.Sequential(nn.Linear(4 + n * (n - 1) // 2, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(),
                                 nn.Linear(8, 1))
        ours = [m for m in [*model.bottom.values(), *model.top.values()] if isinstance(m, nn.Linear)]
        for mine, theirs in zip([m for m in [*self.bottom, *self.top] if isinstance(m, nn.Linear)], ours):
            mine.load_state_dict(theirs.state_dict())

    def forward(self, features, dense):
        x = self.bottom(dense)
        vectors = [x] + [self.tables[f.name](features[f.name]) for f in FEATURES]
        dots = [(vectors[i] * vectors[j]).sum(1) for i in range(len(vectors)) for j in range(i + 1, len(vectors))]
        return self.top(torch.cat([x, torch.stack(dots, dim=1)], dim=1)).squeeze(1)


def test_dlrm_trains_as_plain_pytorch_with_sparse_adam():
    torch.manual_seed(0)
    model = DLRM(FEATURES, 3, CONFIG)
    ref = Reference(model)
    sparse = LazyAdam(list(host_tables(model).values()))
    sparse.hyper["lr"] = 0.01
    dense = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("deep.")], lr=0.01)
    ref_sparse = torch.optim.SparseAdam(list(ref.tables.parameters()), lr=0.01)
    ref_dense = torch.optim.Adam([*ref.bottom.parameters(), *ref.top.parameters()], lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(15):
        features = {f.name: torch.randint(0, f.vocab_size, (32,), generator=g) for f in FEATURES}
        x, y = torch.randn(32, 3, generator=g), torch.randint(0, 2, (32,), generator=g).float()
        for net, opts in ((model, (dense, sparse)), (ref, (ref_dense, ref_sparse))):
            for o in opts:
                o.zero_grad()
            nn.functional.binary_cross_entropy_with_logits(net(features, x), y).backward()
            for o in opts:
                o.step()
        torch.testing.assert_close(model(features, x), ref(features, x), rtol=1e-5, atol=1e-6)
    for f in FEATURES:
        torch.testing.assert_close(model.deep.tables[f"deep_{f.name}"].weight.detach(), ref.tables[f.name].weight,
                                   rtol=1e-5, atol=1e-6)


def test_dlrm_trains_from_a_job_file_and_predict_scores_it(tmp_path, capsys):
    import pyarrow.parquet as pq
    from sklearn.metrics import roc_auc_score

    job = _job(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--config", str(job), "--model", "dlrm", "--bottom", "8", "--hidden", "16",
                 "--run-dir", str(run)]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["test_auc"] > 0.75
    out = tmp_path / "scores.parquet"
    assert main(["predict", "--checkpoint", str(run / "checkpoint.pt"), "--data", str(tmp_path / "test.csv"),
                 "--out", str(out), "--config", str(job)]) == 0
    scores = pq.read_table(out)
    assert roc_auc_score(scores.column("label").to_numpy(), scores.column("score").to_numpy()) == \
        pytest.approx(metrics["test_auc"], abs=1e-9)
    assert main(["train", "--config", str(job), "--model", "dlrm", "--zero", "1", "--run-dir", str(tmp_path / "z")]) == 1
    assert "parallelism.zero (--zero) splits Wide & Deep's MLP; model.name = dlrm (--model dlrm) trains data-parallel: drop it" in capsys.readouterr().err
