"""Evaluation metrics (scikit-learn), the run's plot (matplotlib, headless) and its report files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def binary_metrics(label: np.ndarray, prob: np.ndarray) -> dict[str, float | None]:
    """ROC AUC and log loss of predicted probabilities ``prob`` for binary ``label`` (both ``(N,)``).

    A metric that is undefined is ``None`` (JSON ``null``), never NaN: AUC when ``label`` holds one
    class only, both when there are no samples.
    """
    from sklearn.metrics import log_loss, roc_auc_score

    if label.size == 0:
        return {"auc": None, "logloss": None}
    prob = np.clip(prob.astype(np.float64), 1e-7, 1 - 1e-7)
    auc = float(roc_auc_score(label, prob)) if np.unique(label).size == 2 else None
    return {"auc": auc, "logloss": float(log_loss(label, prob, labels=[0, 1]))}


def plot_curves(losses: list[float], history: dict[str, list], chosen: int | None, path: Path) -> Path:
    """Write a PNG of a run: the training log loss per step and its moving average beside the
    validation log loss at each epoch's end, on an axis of whole epochs; the validation AUC per
    epoch; the chosen epoch (the one that scored the test split) marked on both. ``history``: the
    trainer's (``epoch``, ``valid_auc``, ``valid_logloss``, ``steps``: the step count at each epoch's
    end)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs, ends = history["epoch"], history.get("steps") or []
    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(11, 4))
    per_epoch = ends[0] if ends else max(len(losses), 1)  # steps of an epoch (the first's: a resume keeps it)
    x = np.arange(1, len(losses) + 1) / per_epoch
    ax_loss.plot(x, losses, lw=0.5, alpha=0.4, label="training, per step")
    if len(losses) >= 20:
        w = max(len(losses) // 50, 10)
        ax_loss.plot(x[w - 1 :], np.convolve(losses, np.ones(w) / w, mode="valid"), lw=1.5, label=f"training, mean of {w}")
    if epochs:
        at = [e / per_epoch for e in ends] if len(ends) == len(epochs) else epochs
        ax_loss.plot(at, [np.nan if v is None else v for v in history["valid_logloss"]], marker="o", label="validation")
    ax_loss.set(xlabel="epoch", ylabel="log loss", title="Log loss")
    ax_auc.plot(epochs, [np.nan if a is None else a for a in history["valid_auc"]], marker="o")  # undefined: a gap
    ax_auc.set(xlabel="epoch", ylabel="AUC", title="Validation AUC")
    ax_auc.grid(alpha=0.3)
    for ax in (ax_loss, ax_auc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs
        if chosen:
            ax.axvline(chosen, color="tab:red", ls="--", lw=1, label=f"chosen: epoch {chosen}")
    ax_loss.legend()
    ax_auc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(run_dir: Path, losses: list[float], metrics: dict[str, Any]) -> dict[str, Any]:
    """A finished run's readable files (rank 0 writes them): ``losses.csv`` (the loss per
    step), ``curves.png`` (:func:`plot_curves`: the log losses, the validation AUC, the chosen epoch) and
    ``metrics.json`` (``metrics`` with the plot's path); returns the metrics written."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "losses.csv", "w") as f:
        f.write("step,loss\n" + "".join(f"{i + 1},{v!r}\n" for i, v in enumerate(losses)))
    history = metrics["history"]
    plot = plot_curves(losses, history, metrics.get("test_epoch"), run_dir / "curves.png")
    metrics = {**metrics, "plot": str(plot)}
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, allow_nan=False) + "\n")
    return metrics


class StreamingBinaryMetrics:
    """ROC AUC and log loss of probabilities fed in pieces (``hetero predict``'s, over a file of any
    length), resident memory flat in the row count.

    The log loss is exact (a float64 sum, probabilities clipped to ``[1e-7, 1 - 1e-7]`` as
    :func:`binary_metrics` clips them). The AUC is the Mann-Whitney statistic over a histogram of
    the probabilities in :attr:`BINS` equal bins of ``[0, 1]`` (16 MiB of counts): a positive and
    a negative in one bin count as a tie (a half), so it differs from the exact AUC by at most half
    the share of positive-negative pairs whose scores lie within ``2**-20`` of each other.
    """

    BINS = 1 << 20

    def __init__(self) -> None:
        self.counts = np.zeros((2, self.BINS), dtype=np.int64)  # negatives, positives per bin
        self.loss, self.rows = 0.0, 0

    def add(self, label: np.ndarray, prob: np.ndarray) -> None:
        """``label`` ``(N,)`` 0/1 and ``prob`` ``(N,)`` float probabilities."""
        label, prob = np.asarray(label).astype(np.int64), np.asarray(prob, np.float64)
        p = np.clip(prob, 1e-7, 1 - 1e-7)
        self.loss -= float(np.where(label == 1, np.log(p), np.log1p(-p)).sum())
        bins = np.clip((prob * self.BINS).astype(np.int64), 0, self.BINS - 1)
        np.add.at(self.counts, (label, bins), 1)
        self.rows += label.shape[0]

    def metrics(self) -> dict[str, float | None]:
        """``auc`` and ``logloss``; ``None`` where undefined (no rows; one class for the AUC)."""
        if not self.rows:
            return {"auc": None, "logloss": None}
        neg, pos = self.counts
        below = np.cumsum(neg) - neg  # negatives in lower bins
        pairs = int(neg.sum()) * int(pos.sum())
        auc = float(((pos * below).sum() + 0.5 * (pos * neg).sum()) / pairs) if pairs else None
        return {"auc": auc, "logloss": self.loss / self.rows}
