"""The root of the tests: every directory below sees the fixtures of tests/support/fixtures.py through this file.
Where a test goes: tests/unit/<package>/test_<module>.py for stk/<package>/<module>.py (tests/unit/test_<module>.py
for a top-level module), tests/integration/ for tests that start MPI ranks, servers or Slurm (marked integration),
tests/support/ for what tests share."""

from support.cache_builds import big_clean, big_scan, built, models, scanned  # noqa: F401  (stk-cache's end-to-end builds)
from support.fixtures import (  # noqa: F401  (fixtures, found by name)
    _fresh_op_builds,
    _no_shared_memory_left_behind,
    cache,
    copied,
    dataset,
    format_corpus,
    keep_logging,
    mount,
    one_rank,
    receiver,
    run_scan,
    s3_server,
    scan,
    sdxl,
    setups,
    slurm,
    trained,
)
from support.s3_outages import weed  # noqa: F401  (a test's own S3 server, to stop and kill)
from support.scan_outputs import corpus  # noqa: F401  (a tree with every kind of bad file, for stk-scan)
from support.slurm_cluster import slurm_cluster  # noqa: F401  (the real one-node Slurm)
from support.slurm_nodes import slurm_nodes  # noqa: F401  (the real four-node Slurm)
from support.tiny_models import tiny_encoders, tiny_model  # noqa: F401  (each family's tiny pipeline and encoders)
from support.train_caches import train_data_built  # noqa: F401  (the cache stk.train.data.loader is tested on)
