"""Whether the encoders fit the device: the sizes read from a tiny model's real checkpoint files, the decision fed
with them and a free-memory figure, and the peak measured around the text pass."""

from __future__ import annotations

import pytest
import torch

from stk.cache.memory import GB, Footprint, check_fits, fit_problem, footprint, free_memory, load_failure, measured
from stk.models import Family, build_tiny_model, load_encoders


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(Family.QWENIMAGE, str(tmp_path_factory.mktemp("qwenimage") / "model"))


def _bytes(modules: list[torch.nn.Module]) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_footprint_read_from_the_safetensors_headers_is_what_the_loaded_weights_take(
    qwen_model: str, dtype: torch.dtype
) -> None:
    need = footprint(qwen_model, dtype)
    encoders = load_encoders(qwen_model, Family.QWENIMAGE, "cpu", dtype)
    assert need == Footprint(_bytes([e.model for e in encoders.text]), _bytes([encoders.vae]))


def test_one_pass_two_passes_or_nothing_fits_each_says_so_with_the_text_encoders_size(qwen_model: str) -> None:
    need = footprint(qwen_model, torch.bfloat16)
    assert need is not None and 0 < need.text < need.vae  # the tiny model's VAE is the larger; the rule is the same
    size = f"{need.text / GB:.1f} GB of text encoders"

    assert fit_problem(need, 10 * (need.text + need.vae), two_pass=False, device="cuda:0") is None
    together = int((need.text + need.vae) / 0.9) - 1  # both do not fit at once, each fits alone
    one_pass = fit_problem(need, together, two_pass=False, device="cuda:0")
    assert one_pass is not None and size in one_pass and "rerun with --two-pass" in one_pass and "cuda:0" in one_pass
    assert fit_problem(need, together, two_pass=True, device="cuda:0") is None

    too_small = int(need.text / 0.9) - 1  # not even the text encoders alone
    for two_pass in (False, True):
        alone = fit_problem(need, too_small, two_pass=two_pass, device="cuda:0")
        assert alone is not None and size in alone and "even alone (--two-pass does not help)" in alone
    host = fit_problem(need, together, two_pass=True, device="cpu")  # in host memory both stay loaded
    assert host is not None and "host with more memory" in host and "--two-pass does not help on the CPU" in host


def test_the_check_passes_on_this_host_and_an_out_of_memory_load_names_the_fix(qwen_model: str) -> None:
    cpu = torch.device("cpu")
    free = free_memory(cpu)
    assert free is not None and free > 0
    assert check_fits(qwen_model, cpu, torch.float32, two_pass=False, ranks_here=2) == footprint(
        qwen_model, torch.float32
    )
    need = Footprint(int(48e9), int(0.2e9))
    gpu = str(load_failure("m", torch.device("cuda", 0), need, two_pass=False))
    assert (
        gpu == "m: out of memory on cuda:0 while loading its encoders (48.0 GB of text encoders, a 0.2 GB VAE): "
        "rerun with --two-pass (one model on the device at a time)"
    )
    assert "GPU with more memory" in str(load_failure("m", torch.device("cuda", 0), need, two_pass=True))


def test_the_text_pass_is_timed_and_its_peak_is_the_process_high_water_mark_on_the_cpu() -> None:
    with measured(torch.device("cpu")) as text:
        block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB touched
        del block
    assert text.seconds > 0 and text.peak_of == "process peak RSS"
    assert text.peak_bytes >= 64 * 2**20
