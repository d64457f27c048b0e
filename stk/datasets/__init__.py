"""Several datasets in one run: the list, each dataset's own settings, and the formats it is read from."""

from stk.datasets.formats import Datasets, datasets_in_config, read_datasets
from stk.datasets.spec import DatasetSpec, check_datasets, dataset_from_table
from stk.datasets.write import datasets_toml

__all__ = [
    "DatasetSpec",
    "Datasets",
    "check_datasets",
    "dataset_from_table",
    "datasets_in_config",
    "datasets_toml",
    "read_datasets",
]
