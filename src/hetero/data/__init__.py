"""Datasets: in-memory tabular data, public data sets fetched and checked, MNIST and CIFAR-10; a
user's files through a feature schema (``schema``, ``readers``, ``encode``, ``stream``, ``prepare``)."""

from hetero.data.cifar import load_cifar10, read_cifar10_bin
from hetero.data.fetch import default_cache_dir, fetch_public
from hetero.data.mnist import load_mnist, read_idx
from hetero.data.tabular import Batch, BatchConfig, Batches, Feature, FeatureRole, Jagged, TabularDataset

__all__ = [
    "Batch",
    "BatchConfig",
    "Batches",
    "Feature",
    "FeatureRole",
    "Jagged",
    "TabularDataset",
    "default_cache_dir",
    "fetch_public",
    "load_cifar10",
    "load_mnist",
    "read_idx",
    "read_cifar10_bin",
]
