"""One rank of stk-train as DeepSpeed's MPI launcher starts it: `python .../stk/cli/rank.py ARGS`
(by path: its `--module` is broken with `--launcher mpich`; `python -m stk.cli.rank` works too).

The rank registers in stk-launch's status directory and records its exit code there, which
DeepSpeed's launcher loses (see stk.launch).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    """Run stk-train in this process as a registered rank and return its exit code. stk is
    imported here, after the sys.path fix below, not at the top."""
    from stk.cli.train import main as train_main
    from stk.launch.status import run_rank

    return run_rank(argv, train_main)


if __name__ == "__main__":
    # Run by path, Python put stk/cli/ first on sys.path: its modules (train, scan, launch ...)
    # must not shadow top-level ones of other packages.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    sys.exit(main(sys.argv[1:]))
