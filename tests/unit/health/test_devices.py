"""stk.health devices: the real NVML backend on a machine without a GPU, its per-device logic
against a stand-in NVML module, the scripted backend across processes, and a light import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest
from support.fake_nvml import H100, FakeNvml, nvml_error, nvml_present

from stk.errors import InputError
from stk.health.check import report_json_lines, report_text, run_check
from stk.health.devices import (
    SCRIPT_ENV,
    NoDriver,
    NvmlBackend,
    NvmlFailed,
    ScriptedBackend,
    backend_from_env,
)
from stk.health.report import GpuSample, Severity
from stk.health.rules import Thresholds

# --- NVML without a GPU (this machine) ---------------------------------------------------------


@pytest.mark.skipif(nvml_present(), reason="this machine has an NVIDIA driver")
def test_nvml_without_a_driver_is_unknown() -> None:
    with pytest.raises(NoDriver, match="Not Found"):
        NvmlBackend().sample()
    report = run_check(NvmlBackend(), 8, Thresholds())
    assert (report.severity, int(report.severity), report.gpus) == (Severity.UNKNOWN, 3, 0)
    assert report_text(report).startswith("UNKNOWN: no NVIDIA driver: ")
    assert json.loads(report_json_lines(report).splitlines()[-1])["exit_code"] == 3


# --- NVML per-device logic, against a stand-in module -------------------------------------------


def test_nvml_readings_of_a_gpu() -> None:
    (sample,) = NvmlBackend(FakeNvml([H100])).sample()
    assert sample == GpuSample(
        index=0,
        uuid="GPU-a",
        name="NVIDIA H100 80GB HBM3",
        temperature=41,
        shutdown_temperature=92,
        slowdown_temperature=89,
        ecc_volatile_uncorrectable=0,
        remap_pending=True,
        remap_failure=False,
        clock_event_reasons=0x4,
        pcie_gen=5,
        pcie_gen_max=5,
        pcie_width=16,
        pcie_width_max=16,
        nvlink_active=(True,) * 17 + (False,),
        utilization=97,
    )


def test_nvml_unsupported_readings_are_none() -> None:
    (sample,) = NvmlBackend(FakeNvml([{"uuid": "GPU-b", "sbe": 3, "dbe": 1, "pages_pending": 1}])).sample()
    assert sample.answered
    assert (sample.retired_pages_sbe, sample.retired_pages_dbe, sample.retired_pages_pending) == (3, 1, True)
    assert sample.temperature is sample.ecc_volatile_uncorrectable is sample.remap_pending is None
    assert sample.nvlink_active is sample.pcie_gen is sample.utilization is sample.clock_event_reasons is None


def test_nvml_a_gpu_that_fails_does_not_answer() -> None:
    lost = {**H100, "uuid": "GPU-c", "ecc": nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)}
    samples = NvmlBackend(FakeNvml([H100, lost])).sample()
    assert [s.answered for s in samples] == [True, False]
    assert (samples[1].uuid, samples[1].error) == ("GPU-c", "GPU is lost")


def test_nvml_xids_are_reported_once_on_their_gpu() -> None:
    fake = FakeNvml([H100, {**H100, "uuid": "GPU-d"}])
    backend = NvmlBackend(fake)
    assert [s.xids for s in backend.sample()] == [(), ()]
    fake.xids = [(1, 79), (1, 13)]
    assert [s.xids for s in backend.sample()] == [(), (79, 13)]
    assert [s.xids for s in backend.sample()] == [(), ()]


def test_nvml_init_failures() -> None:
    with pytest.raises(NoDriver):
        NvmlBackend(FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)).sample()
    with pytest.raises(NvmlFailed, match="nvmlInit: Unknown Error"):
        NvmlBackend(FakeNvml([], init_error=pynvml.NVML_ERROR_UNKNOWN)).sample()
    report = run_check(NvmlBackend(FakeNvml([], init_error=pynvml.NVML_ERROR_UNKNOWN)), 8, Thresholds())
    assert report.severity == Severity.CRITICAL
    assert report_text(report) == "CRITICAL: NVML does not answer: nvmlInit: Unknown Error"


# --- the scripted backend ---------------------------------------------------------------------


def write_script(path: Path, temperatures: list[int]) -> Path:
    runs = [[{"index": 0, "uuid": "GPU-s", "name": "scripted", "temperature": t, "xids": []}] for t in temperatures]
    path.write_text(json.dumps(runs))
    return path


def test_scripted_backend_advances_across_instances_and_repeats_the_last(tmp_path: Path) -> None:
    script = write_script(tmp_path / "gpus.json", [40, 50, 60])
    seen = [ScriptedBackend(script).sample()[0].temperature for _ in range(5)]  # a new process each time
    assert seen == [40, 50, 60, 60, 60]
    assert (tmp_path / "gpus.json.pos").read_text().strip() == "5"


def test_scripted_backend_advances_across_processes(tmp_path: Path) -> None:
    script = write_script(tmp_path / "gpus.json", [40, 50])
    code = "from stk.health.devices import backend_from_env; print(backend_from_env().sample()[0].temperature)"
    env = {"PATH": "/usr/bin:/bin", SCRIPT_ENV: str(script)}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True) for _ in range(3)]
    assert [run.returncode for run in runs] == [0, 0, 0], runs[0].stderr
    seen = [run.stdout for run in runs]
    assert seen == ["40\n", "50\n", "50\n"]


def test_scripted_findings_reach_the_report(tmp_path: Path) -> None:
    runs = [[{"index": 0, "uuid": "GPU-s", "name": "scripted", "ecc_volatile_uncorrectable": 1}]]
    (tmp_path / "gpus.json").write_text(json.dumps(runs))
    report = run_check(ScriptedBackend(tmp_path / "gpus.json"), 1, Thresholds())
    assert report_text(report) == "CRITICAL: GPU 0 (GPU-s): volatile uncorrectable ECC errors 1 > 0"


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ("[]", "expected a non-empty list of runs"),
        ("{", "not valid JSON"),
        ('[[{"index": 0, "uuid": "u", "name": "n", "temprature": 3}]]', "unknown GPU sample field"),
        ('[[{"index": 0}]]', "run 0"),
    ],
)
def test_scripted_backend_rejects_bad_scripts(tmp_path: Path, content: str, error: str) -> None:
    (tmp_path / "gpus.json").write_text(content)
    with pytest.raises(InputError, match=error):
        ScriptedBackend(tmp_path / "gpus.json").sample()


def test_backend_from_env(tmp_path: Path) -> None:
    assert isinstance(backend_from_env({SCRIPT_ENV: str(tmp_path / "x.json")}), ScriptedBackend)
    assert isinstance(backend_from_env({}), NvmlBackend)


def test_sample_dicts_round_trip() -> None:
    sample = GpuSample(index=1, uuid="u", name="n", nvlink_active=(True, False), xids=(79,))
    assert GpuSample.from_dict(json.loads(json.dumps(sample.to_dict()))) == sample


# --- start-up stays light -----------------------------------------------------------------------


def test_health_imports_no_heavy_framework() -> None:
    code = (
        "import sys, stk.health, stk.health.report, stk.health.devices, stk.health.rules, stk.health.check\n"
        "heavy = [m for m in ('torch', 'deepspeed', 'diffusers', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
