"""Datasets: in-memory tabular data, MovieLens-100K, the Criteo TSV format, MNIST and CIFAR-10."""

from hetero.data.cifar import load_cifar10, read_cifar10_bin
from hetero.data.criteo import CriteoConfig, read_criteo_tsv
from hetero.data.fetch import default_cache_dir
from hetero.data.mnist import load_mnist, read_idx
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
    "default_cache_dir",
    "load_cifar10",
    "load_mnist",
    "read_idx",
    "fetch_movielens_100k",
    "load_movielens_100k",
    "read_cifar10_bin",
    "read_criteo_tsv",
]
