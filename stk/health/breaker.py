"""A circuit breaker for training: a thread that watches this rank's GPU and stops the job at the
next step boundary once the GPU has a critical fault, instead of letting it hang in NCCL or write
NaNs into a checkpoint.

The thread samples only its own GPU every `interval` seconds and applies the health rules (with
the previous sample, for the two-sample rules). On the first CRITICAL finding it records the fault,
sends one gpu.fault alert (with rank, host and job id) and stops. The training loop reads
`fault` at each step boundary: it sees the recorded fault and never touches NVML itself.

    with GpuWatch(None, rank=world.rank, notify_config="/etc/stk/apprise.yml") as watch:
        for batch in loader:
            if watch.fault is not None:
                ...  # stop at this step
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from types import TracebackType

from stk.cluster.slurm import job_id
from stk.errors import InputError
from stk.health.alerts import apply, plan_events, send
from stk.health.devices import DeviceBackend, NoDriver, NvmlFailed, backend_from_env
from stk.health.report import Finding, GpuSample, Report, Severity
from stk.health.rules import Thresholds, evaluate
from stk.health.state import AlertState, locked
from stk.log import get_logger

__all__ = ["GpuWatch", "local_gpu_index"]

log = get_logger("health.breaker")

_DEFAULT_THRESHOLDS = Thresholds()  # frozen: one instance serves every watch


def local_gpu_index(environ: dict[str, str] | None = None) -> int:
    """The NVML index of this rank's GPU: visible device LOCAL_RANK (stk.cluster.world's local rank when
    unset), mapped through CUDA_VISIBLE_DEVICES when that lists indices. CUDA numbers devices
    fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID; on a node of identical GPUs both orders
    are NVML's (PCI bus) order."""
    env = os.environ if environ is None else environ
    local = env.get("LOCAL_RANK", "")
    if local.isdigit():
        position = int(local)
    else:
        from stk.cluster.world import get_world

        position = get_world().local_rank
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return position
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if position >= len(entries):
        raise InputError(f"local rank {position} has no GPU: CUDA_VISIBLE_DEVICES={visible!r}")
    if not entries[position].isdigit():
        raise InputError(f"CUDA_VISIBLE_DEVICES={visible!r} names GPUs by UUID: pass the NVML index of this rank's GPU")
    return int(entries[position])


class GpuWatch:
    """Watches one GPU from a daemon thread; see the module docstring.

    gpu_index: NVML index to watch (None: `local_gpu_index()`). backend: where readings come from
    (None: NVML reading only this GPU, or STK_HEALTH_SCRIPT's script). notify_urls/notify_config:
    apprise targets for the alert (none: no alert). state_path: the stk-health alert state to share
    with cron, so a fault it already reported is not reported twice; None sends regardless.
    """

    def __init__(
        self,
        gpu_index: int | None,
        interval: float = 10.0,
        thresholds: Thresholds = _DEFAULT_THRESHOLDS,
        backend: DeviceBackend | None = None,
        notify_urls: Sequence[str] = (),
        notify_config: str | None = None,
        state_path: str | None = None,
        rank: int | None = None,
    ) -> None:
        self.gpu_index = local_gpu_index() if gpu_index is None else gpu_index
        self.interval = interval
        self.thresholds = thresholds
        self.backend = backend_from_env(devices=[self.gpu_index]) if backend is None else backend
        self.notify_urls = list(notify_urls)
        self.notify_config = notify_config
        self.state_path = state_path
        self.rank = rank
        self._lock = threading.Lock()
        self._fault: Finding | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: list[GpuSample] = []

    @property
    def fault(self) -> Finding | None:
        """The critical finding that tripped the breaker, None while the GPU is healthy."""
        with self._lock:
            return self._fault

    @property
    def active(self) -> bool:
        """Whether the thread is sampling (False without a driver, after a fault, after stop())."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> GpuWatch:
        """Take the first sample here (a GPU already faulty trips at once, no driver logs once and
        leaves the watch inactive), then sample from a daemon thread."""
        if self._thread is not None:
            raise RuntimeError("GpuWatch already started")
        self._stopping.clear()
        if self._step():
            self._thread = threading.Thread(target=self._run, name=f"stk-gpu-watch-{self.gpu_index}", daemon=True)
            self._thread.start()
        return self

    def report_error(self, message: str) -> None:
        """Open the breaker for an error the training step itself met (a CUDA or NCCL error), with
        the same alert a sampled fault sends."""
        self._trip([], Finding("gpu_error", Severity.CRITICAL, message, self.gpu_index))

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop sampling and wait for the thread (and an alert it is sending) to end."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "GPU %d watch did not stop within %s s (NVML or an alert endpoint hangs)", self.gpu_index, timeout
                )

    def __enter__(self) -> GpuWatch:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stopping.wait(self.interval) and self._step():
            pass

    def _step(self) -> bool:
        """One sample and its verdict; False when there is nothing more to watch."""
        try:
            samples = self.backend.sample()
        except NoDriver:
            log.info("no NVIDIA driver: nothing to watch")
            return False
        except NvmlFailed as exc:
            return self._trip([], Finding("gpu_unresponsive", Severity.CRITICAL, f"NVML does not answer: {exc}"))
        except Exception:  # a bug or a bad script must not end the training
            log.exception("GPU %d watch failed: GPU faults are no longer detected in this rank", self.gpu_index)
            return False
        mine = [s for s in samples if s.index == self.gpu_index]
        if not mine:
            message = f"GPU {self.gpu_index}: not among the {len(samples)} GPU(s) NVML lists"
            return self._trip([], Finding("gpu_unresponsive", Severity.CRITICAL, message, self.gpu_index))
        findings = evaluate(mine, None, self.thresholds, self._previous)
        self._previous = mine
        critical = [f for f in findings if f.severity == Severity.CRITICAL]
        return self._trip(mine, critical[0]) if critical else True

    def _trip(self, samples: list[GpuSample], finding: Finding) -> bool:
        """Record the fault (the training loop sees it from now on), then alert; always False."""
        with self._lock:
            self._fault = finding
        log.error("GPU fault, training stops at the next step: %s", finding.message)
        report = Report(socket.gethostname(), job_id(os.environ), 1, (finding,), tuple(samples))
        if self.notify_urls or self.notify_config is not None:
            try:
                self._alert(report)
            except Exception:  # the fault stands: the alert is the lesser loss
                log.exception("GPU fault alert not sent")
        return False

    def _alert(self, report: Report) -> None:
        """Send the gpu.fault alert; with a state file, only if cron has not already sent it. Only
        fault events are sent: the state holds other GPUs' faults this watch knows nothing about."""
        now = time.time()
        if self.state_path is None:
            send(plan_events(report, AlertState(), now, 0, rank=self.rank), self.notify_urls, self.notify_config)
            return
        with locked(self.state_path):
            state = AlertState.load(self.state_path)
            events = [e for e in plan_events(report, state, now, 0, rank=self.rank) if e.type == "gpu.fault"]
            delivered = send(events, self.notify_urls, self.notify_config)
            apply(state, events, delivered, now)
            state.save(self.state_path)
