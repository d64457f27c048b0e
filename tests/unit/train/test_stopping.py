"""stk.train.stopping: stop signals, recorded in the step loop and fatal before it."""

from __future__ import annotations

import signal

from stk.train.stopping import StopSignals


def test_stop_signals_in_the_step_loop_are_recorded_not_fatal():
    signals = StopSignals().install()
    signals.defer()  # the step loop runs (before it a signal ends the run: tests/unit/train/deepspeed/test_opbuilds.py)
    try:
        signal.raise_signal(signal.SIGUSR2)
        signal.raise_signal(signal.SIGTERM)
        assert signals.received == "SIGUSR2"  # the first one names the reason
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
