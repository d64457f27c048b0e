"""Logging to stderr with the rank and host in every line, so merged sbatch logs stay readable."""

from __future__ import annotations

import logging
import sys

from stk.cluster.world import World

__all__ = ["get_logger", "setup_logging"]


def setup_logging(command: str, world: World, verbosity: int = 0) -> None:
    """verbosity: -1 quiet (warnings only), 0 info on rank 0 and warnings elsewhere, 1 debug."""
    if verbosity < 0:
        level = logging.WARNING
    elif verbosity > 0:
        level = logging.DEBUG
    else:
        level = logging.INFO if world.is_root else logging.WARNING
    prefix = f"{command}" if world.size == 1 else f"{command} r{world.rank}@{world.node}"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix} %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("stk")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith("stk") else f"stk.{name}")
