"""Datasets and client partitions for fedge: the one import path for them.

Every process (server and each client) calls the same functions with the same
specs and seeds, so splits and partitions are computed deterministically instead
of being shipped over the network. Nothing is cached on disk. Each job has its module:

- :mod:`edge_client.datasets`: loading a data set from a spec, and its fixed train/test split;
- :mod:`edge_client.label_partitions`: label partitions (iid, dirichlet, shards);
- :mod:`edge_client.attribute_skew`: attribute skew, the domains' images and what a model trained
  under it is normalized and evaluated with;
- :mod:`edge_client.partitions`: what each client trains on.
"""

from __future__ import annotations

from edge_client.attribute_skew import (ATTRIBUTE_KINDS, COLOR_KINDS, COLOR_NORMALIZATION, AttributeSkew,
                                        domain_palette, evaluation_split, model_normalization, parse_attribute_skew,
                                        pixel_normalization)
from edge_client.datasets import (DATASET_SPECS, DIGITS_MEAN, DIGITS_NORMALIZATION, DIGITS_STD,
                                  FASHION_MNIST_CLASSES, FASHION_MNIST_DIR, FASHION_MNIST_MEAN,
                                  FASHION_MNIST_NORMALIZATION, FASHION_MNIST_STD, DataError, Dataset, RawDataset,
                                  load_dataset, load_pixels, read_fashion_mnist)
from edge_client.label_partitions import PARTITION_SPECS, describe_partitions, parse_label_spec
from edge_client.partitions import (ClientRows, arrange_clients, client_pixels, client_split, holdout_split,
                                    load_client_split, partition_indices)

__all__ = [
    "DataError",
    "Dataset",
    "RawDataset",
    "load_dataset",
    "load_pixels",
    "read_fashion_mnist",
    "client_pixels",
    "model_normalization",
    "pixel_normalization",
    "partition_indices",
    "parse_label_spec",
    "client_split",
    "load_client_split",
    "ClientRows",
    "arrange_clients",
    "describe_partitions",
    "holdout_split",
    "AttributeSkew",
    "ATTRIBUTE_KINDS",
    "COLOR_KINDS",
    "parse_attribute_skew",
    "domain_palette",
    "evaluation_split",
    "DATASET_SPECS",
    "PARTITION_SPECS",
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_NORMALIZATION",
    "DIGITS_MEAN",
    "DIGITS_STD",
    "DIGITS_NORMALIZATION",
    "COLOR_NORMALIZATION",
]
