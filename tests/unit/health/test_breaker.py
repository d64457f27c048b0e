"""The training circuit breaker (stk.health.breaker): scripted GPUs that stay healthy or fail, a fault on another
rank's GPU, and this machine's no-driver path through the real NVML backend. The alert it sends:
tests/integration/test_health_breaker.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from support.breaker import FAST, ecc_on, healthy, script, wait_for
from support.fake_nvml import H100, FakeNvml, nvml_present

from stk.errors import InputError
from stk.health.breaker import GpuWatch, local_gpu_index
from stk.health.devices import NvmlBackend, ScriptedBackend


def runs_read(backend: ScriptedBackend) -> int:
    return int(backend.position_path.read_text())


def test_a_healthy_gpu_never_trips(tmp_path: Path) -> None:
    backend = script(tmp_path, [healthy()])
    with GpuWatch(2, interval=FAST, backend=backend) as watch:
        wait_for(lambda: runs_read(backend) >= 20)
        assert watch.active and watch.fault is None
    assert not watch.active


def test_an_uncorrectable_ecc_on_the_watched_gpu_trips_within_a_few_intervals(tmp_path: Path) -> None:
    backend = script(tmp_path, [healthy(), healthy(), ecc_on(3)])
    with GpuWatch(3, interval=FAST, backend=backend) as watch:
        assert watch.fault is None  # the first sample (taken by start) was healthy
        wait_for(lambda: watch.fault is not None, seconds=100 * FAST)
        fault = watch.fault
        assert fault is not None and "GPU 3 (GPU-00000003): volatile uncorrectable ECC" in fault.message
        wait_for(lambda: not watch.active)
    assert fault.check == "ecc_uncorrectable" and fault.gpu_index == 3
    assert runs_read(backend) == 3  # sampling stopped at the fault


def test_a_fault_present_at_start_trips_before_the_first_step(tmp_path: Path) -> None:
    with GpuWatch(1, interval=60, backend=script(tmp_path, [ecc_on(1)])) as watch:
        assert not watch.active
        assert watch.fault is not None and "GPU 1" in watch.fault.message


def test_a_fault_on_another_gpu_does_not_trip_this_rank(tmp_path: Path) -> None:
    backend = script(tmp_path, [healthy(), ecc_on(3)])
    with GpuWatch(0, interval=FAST, backend=backend) as watch:
        wait_for(lambda: runs_read(backend) >= 10)
        assert watch.active and watch.fault is None


def test_a_gpu_missing_from_the_readings_trips(tmp_path: Path) -> None:
    with GpuWatch(5, interval=60, backend=script(tmp_path, [healthy()])) as watch:
        fault = watch.fault
    assert fault is not None and fault.message == "GPU 5: not among the 4 GPU(s) NVML lists"


class CountingNvml(FakeNvml):
    """FakeNvml that records which GPUs were read and which registered for XID events."""

    def __init__(self, gpus: list[dict[str, Any]]) -> None:
        super().__init__(gpus)
        self.read: set[int] = set()
        self.registered: list[int] = []

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        self.read.add(handle)
        return super().nvmlDeviceGetUUID(handle)

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, events: str) -> None:
        self.registered.append(handle)


def test_nvml_reads_only_the_watched_gpu_and_trips_on_its_xid() -> None:
    fake = CountingNvml([{**H100, "uuid": f"GPU-{i}", "remap": (0, 0, 0, 0), "links": [1] * 18} for i in range(4)])
    with GpuWatch(2, interval=FAST, backend=NvmlBackend(fake, devices=[2])) as watch:
        assert watch.active
        fake.xids = [(2, 79)]
        wait_for(lambda: watch.fault is not None)
    assert (fake.read, fake.registered) == ({2}, [2])
    assert watch.fault is not None and "GPU 2 (GPU-2): XID 79 (GPU has fallen off the bus)" in watch.fault.message


@pytest.mark.skipif(nvml_present(), reason="this machine has an NVIDIA driver")
def test_without_a_driver_the_watch_is_inactive(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stk")
    with GpuWatch(0, interval=FAST, backend=NvmlBackend(devices=[0])) as watch:
        assert not watch.active and watch.fault is None
    assert caplog.text.count("no NVIDIA driver: nothing to watch") == 1


@pytest.mark.parametrize(
    ("env", "index"),
    [
        ({"LOCAL_RANK": "2"}, 2),
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,6"}, 6),
        ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": " 7 "}, 7),
    ],
)
def test_the_default_gpu_is_the_local_ranks_visible_device(env: dict[str, str], index: int) -> None:
    assert local_gpu_index(env) == index


@pytest.mark.parametrize("visible", ["0", "", "GPU-8f6c2a1e-0000,GPU-8f6c2a1e-0001"])
def test_a_local_gpu_that_cannot_be_named_is_an_error(visible: str) -> None:
    with pytest.raises(InputError, match="CUDA_VISIBLE_DEVICES"):
        local_gpu_index({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": visible})
