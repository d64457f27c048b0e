"""A stand-in for the pynvml module: what NVML reports for a set of GPUs, for the per-device
logic of the NVML backend on machines without a GPU (the one test double of the suite, behind
the same module interface the real backend calls)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pynvml

__all__ = ["H100", "NOT_SUPPORTED", "FakeNvml", "nvml_error", "nvml_present"]


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


def nvml_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


class FakeNvml:
    """pynvml's interface over a dict per GPU (a handle is the index); constants and errors are
    pynvml's own. A reading missing from a GPU's dict is NotSupported, an exception is raised."""

    def __init__(self, gpus: list[dict[str, Any]], init_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.xids: list[tuple[int, int]] = []  # (gpu index, xid) waiting to be read

    def __getattr__(self, name: str) -> Any:
        return getattr(pynvml, name)

    def _get(self, handle: int, key: str) -> Any:
        value = self.gpus[handle].get(key, nvml_error(NOT_SUPPORTED))
        if isinstance(value, Exception):
            raise value
        return value

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise nvml_error(self.init_error)

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return str(self._get(handle, "uuid"))

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA H100 80GB HBM3"  # older pynvml returns bytes

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return int(self._get(handle, "temperature"))

    def nvmlDeviceGetTemperatureThreshold(self, handle: int, kind: int) -> int:
        return int(self._get(handle, {pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: "shutdown"}.get(kind, "slowdown")))

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return int(self._get(handle, "ecc"))

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        return tuple(self._get(handle, "remap"))

    def nvmlDeviceGetRetiredPages(self, handle: int, cause: int) -> list[int]:
        double = cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        return [0x1000] * int(self._get(handle, "dbe" if double else "sbe"))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        return int(self._get(handle, "pages_pending"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return int(self._get(handle, "reasons"))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: int) -> int:
        return int(self._get(handle, "pcie")[0])

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int) -> int:
        return int(self._get(handle, "pcie")[1])

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: int) -> int:
        return int(self._get(handle, "pcie")[2])

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: int) -> int:
        return int(self._get(handle, "pcie")[3])

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        links = self._get(handle, "links")
        if link >= len(links):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(links[link])

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._get(handle, "util"), memory=0)

    def nvmlEventSetCreate(self) -> str:
        return "event set"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, events: str) -> None:
        assert types == pynvml.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait(self, events: str, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0
        if not self.xids:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
        index, xid = self.xids.pop(0)
        return SimpleNamespace(device=index, eventData=xid, eventType=pynvml.nvmlEventTypeXidCriticalError)


H100 = {
    "uuid": "GPU-a",
    "temperature": 41,
    "shutdown": 92,
    "slowdown": 89,
    "ecc": 0,
    "remap": (0, 0, 1, 0),
    "reasons": 0x4,
    "pcie": (5, 5, 16, 16),
    "links": [1] * 17 + [0],
    "util": 97,
}
