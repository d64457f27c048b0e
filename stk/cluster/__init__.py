"""The cluster a command runs on: the ranks (world), what Slurm says, and the lease that keeps one job on a cache or run
at a time."""
