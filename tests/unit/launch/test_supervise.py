"""stk.launch.supervise: a launcher killed by a signal is exit 128 plus that signal."""

from __future__ import annotations

import sys

from stk.launch.supervise import supervise


def test_supervise_returns_128_plus_the_signal_that_killed_the_launcher():
    assert supervise([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], {}) == 137
