"""Several datasets in one run: the list, each dataset's own settings, and the formats it is read from."""

from stk.datasets.spec import DatasetSpec, check_datasets, dataset_from_table

__all__ = ["DatasetSpec", "check_datasets", "dataset_from_table"]
