"""Datasets: in-memory tabular data, MovieLens-100K and the Criteo TSV format."""

from hetero.data.criteo import CriteoConfig, read_criteo_tsv
from hetero.data.movielens import fetch_movielens_100k, load_movielens_100k
from hetero.data.tabular import Batch, BatchConfig, Batches, Feature, FeatureRole, Jagged, TabularDataset

__all__ = [
    "Batch",
    "BatchConfig",
    "Batches",
    "CriteoConfig",
    "Feature",
    "FeatureRole",
    "Jagged",
    "TabularDataset",
    "fetch_movielens_100k",
    "load_movielens_100k",
    "read_criteo_tsv",
]
