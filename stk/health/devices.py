"""Where GPU readings come from: NVML on a real node, or a JSON script in tests.

The script backend lets tests (and the Slurm tests on CPU-only clusters) make a node look faulty
without a faulty GPU; the check code cannot tell the two apart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Protocol, TypeVar

from stk.errors import InputError
from stk.health.report import GpuSample

__all__ = [
    "SCRIPT_ENV",
    "DeviceBackend",
    "NoDriver",
    "NvmlBackend",
    "NvmlFailed",
    "ScriptedBackend",
    "backend_from_env",
    "node_gpu_count",
]

SCRIPT_ENV = "STK_HEALTH_SCRIPT"

T = TypeVar("T")

# Errors that mean "this query does not exist here" (old driver, GPU without the feature), not a fault.
_ABSENT_ERRORS = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")
# nvmlInit errors that mean there is no NVIDIA driver on this machine at all.
_NO_DRIVER_ERRORS = ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED")
_MAX_EVENTS = 1000  # drained per sample; a bound so a storm of events cannot stall the check


class NoDriver(Exception):
    """No NVIDIA driver or NVML library here: the check cannot say anything (Nagios UNKNOWN)."""


class NvmlFailed(Exception):
    """NVML is installed but failed before any GPU could be asked (often a GPU off the bus)."""


class DeviceBackend(Protocol):
    def sample(self) -> list[GpuSample]:
        """One reading of every GPU on the node; raises NoDriver where there is no driver."""
        ...

    def gpu_count(self) -> int:
        """How many GPUs the node has, reading nothing else; raises NoDriver or NvmlFailed."""
        ...


class NvmlBackend:
    """Reads the GPUs through NVML. `nvml` is the pynvml module (or an object with its interface);
    `devices` limits the readings (and XID events) to those NVML indices, None reads every GPU."""

    def __init__(self, nvml: Any = None, devices: Collection[int] | None = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml = nvml
        self._devices = None if devices is None else sorted(set(devices))
        self._started = False
        self._events: Any = None  # the XID event set, once registered

    def sample(self) -> list[GpuSample]:
        nvml = self._nvml
        if not self._started:
            self._start()
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            raise NvmlFailed(f"nvmlDeviceGetCount: {exc}") from exc
        indices = [i for i in self._devices if i < count] if self._devices is not None else list(range(count))
        if not self._started:
            self._started = True
            self._watch_xids(indices)
        xids = self._drain_xids()
        return [self._sample_one(index, xids.get(index, ())) for index in indices]

    def gpu_count(self) -> int:
        nvml = self._nvml
        self._start()
        try:
            return int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            raise NvmlFailed(f"nvmlDeviceGetCount: {exc}") from exc

    def _start(self) -> None:
        """nvmlInit, once per backend; NoDriver where there is no driver at all."""
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            if _is(nvml, exc, _NO_DRIVER_ERRORS):
                raise NoDriver(str(exc)) from exc
            raise NvmlFailed(f"nvmlInit: {exc}") from exc

    def _watch_xids(self, indices: list[int]) -> None:
        """Register for XID critical events on these GPUs where supported (events before this are missed)."""
        nvml = self._nvml
        try:
            self._events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError:
            return  # no XID events here; the other readings still count
        for index in indices:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
            except nvml.NVMLError:
                continue  # not supported, or the GPU does not answer (sample() reports that)

    def _drain_xids(self) -> dict[int, tuple[int, ...]]:
        """XIDs seen since the last call, by GPU index; waits for nothing (timeout 0)."""
        nvml = self._nvml
        found: dict[int, list[int]] = {}
        if self._events is None:
            return {}
        for _ in range(_MAX_EVENTS):
            try:
                event = nvml.nvmlEventSetWait(self._events, 0)
                index = int(nvml.nvmlDeviceGetIndex(event.device))
            except nvml.NVMLError:
                break  # NVML_ERROR_TIMEOUT: nothing more pending
            found.setdefault(index, []).append(int(event.eventData))
        return {index: tuple(xids) for index, xids in found.items()}

    def _sample_one(self, index: int, xids: tuple[int, ...]) -> GpuSample:
        nvml = self._nvml
        uuid = name = ""
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            name = _text(nvml.nvmlDeviceGetName(handle))
            return GpuSample(index=index, uuid=uuid, name=name, xids=xids, **self._readings(handle))
        except nvml.NVMLError as exc:
            return GpuSample(index=index, uuid=uuid, name=name, answered=False, error=str(exc), xids=xids)

    def _readings(self, handle: Any) -> dict[str, Any]:
        """Every reading the rules use; a query the GPU does not support gives None."""
        nvml, get = self._nvml, self._optional
        remap = get(nvml.nvmlDeviceGetRemappedRows, handle)  # (corrected, uncorrected, pending, failure)
        # the "ClocksEvent" name replaced "ClocksThrottle" in newer NVML; use whichever this one has
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = reasons or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        utilization = get(nvml.nvmlDeviceGetUtilizationRates, handle)
        pending = get(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        ecc_kind = (nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        ecc = get(nvml.nvmlDeviceGetTotalEccErrors, handle, *ecc_kind)
        return {
            "temperature": get(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
            "shutdown_temperature": get(
                nvml.nvmlDeviceGetTemperatureThreshold, handle, nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
            ),
            "slowdown_temperature": get(
                nvml.nvmlDeviceGetTemperatureThreshold, handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
            ),
            "ecc_volatile_uncorrectable": ecc,
            "remap_pending": None if remap is None else bool(remap[2]),
            "remap_failure": None if remap is None else bool(remap[3]),
            "retired_pages_sbe": self._retired(handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
            "retired_pages_dbe": self._retired(handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
            "retired_pages_pending": None if pending is None else pending == nvml.NVML_FEATURE_ENABLED,
            "clock_event_reasons": get(reasons, handle),
            "pcie_gen": get(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
            "pcie_gen_max": get(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
            "pcie_width": get(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
            "pcie_width_max": get(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
            "nvlink_active": self._nvlinks(handle),
            "utilization": None if utilization is None else int(utilization.gpu),
        }

    def _retired(self, handle: Any, cause: int) -> int | None:
        pages = self._optional(self._nvml.nvmlDeviceGetRetiredPages, handle, cause)
        return None if pages is None else len(pages)

    def _nvlinks(self, handle: Any) -> tuple[bool, ...] | None:
        """Active flag of each NVLink the GPU has; None on a GPU without NVLink."""
        nvml = self._nvml
        states = []
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(handle, link)
            except nvml.NVMLError as exc:
                if _is(nvml, exc, (*_ABSENT_ERRORS, "NVML_ERROR_INVALID_ARGUMENT")):
                    continue  # this GPU has fewer links (or none)
                raise
            states.append(state == nvml.NVML_FEATURE_ENABLED)
        return tuple(states) or None

    def _optional(self, fn: Callable[..., T], *args: Any) -> T | None:
        """fn(*args), or None where the GPU or driver does not support it; other errors propagate."""
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            if _is(self._nvml, exc, _ABSENT_ERRORS):
                return None
            raise


def _is(nvml: Any, exc: Exception, names: tuple[str, ...]) -> bool:
    """Whether an NVMLError carries one of the NVML_ERROR_* codes named (by its value, not subclass)."""
    return getattr(exc, "value", None) in {getattr(nvml, name, None) for name in names}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class ScriptedBackend:
    """Replays GPU readings from a JSON file: a list of runs, each a list of GpuSample dicts.

    Each sample() returns the next run, and the last one repeats. The position is kept in
    `<script>.pos` beside it, so separate processes (a check run every minute) advance too.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.position_path = self.path.with_name(self.path.name + ".pos")

    def sample(self) -> list[GpuSample]:
        runs = self._runs()
        position = self._position()
        run = runs[min(position, len(runs) - 1)]
        try:
            samples = [GpuSample.from_dict(item) for item in run]
        except (TypeError, ValueError) as exc:
            raise InputError(f"{SCRIPT_ENV}={self.path}: run {position}: {exc}") from exc
        temp = self.position_path.with_name(self.position_path.name + f".{os.getpid()}")
        temp.write_text(f"{position + 1}\n")
        temp.replace(self.position_path)
        return samples

    def gpu_count(self) -> int:
        """The GPUs of the current run, without moving on to the next."""
        runs = self._runs()
        return len(runs[min(self._position(), len(runs) - 1)])

    def _runs(self) -> list[list[dict[str, Any]]]:
        try:
            runs = json.loads(self.path.read_text())
        except OSError as exc:
            raise InputError(f"{SCRIPT_ENV}={self.path}: {exc.strerror}") from exc
        except json.JSONDecodeError as exc:
            raise InputError(f"{SCRIPT_ENV}={self.path}: not valid JSON ({exc})") from exc
        if not isinstance(runs, list) or not runs or not all(isinstance(run, list) for run in runs):
            raise InputError(f"{SCRIPT_ENV}={self.path}: expected a non-empty list of runs (lists of GPU samples)")
        return runs

    def _position(self) -> int:
        try:
            return int(self.position_path.read_text().strip() or 0)
        except FileNotFoundError:
            return 0
        except ValueError as exc:
            raise InputError(f"{self.position_path}: not a run number") from exc


def node_gpu_count() -> int | None:
    """GPUs on this node by NVML (or the test script); None where there is no driver or NVML fails."""
    try:
        return backend_from_env().gpu_count()
    except (NoDriver, NvmlFailed):
        return None


def backend_from_env(environ: dict[str, str] | None = None, devices: Collection[int] | None = None) -> DeviceBackend:
    """The scripted backend when STK_HEALTH_SCRIPT names a script (it lists every GPU it holds),
    else NVML, reading only `devices` (NVML indices) when given."""
    env = os.environ if environ is None else environ
    script = env.get(SCRIPT_ENV)
    return ScriptedBackend(script) if script else NvmlBackend(devices=devices)
