"""--fp8-matmuls (stk.train.trainable.fp8): which linear layers torchao's Float8Linear takes over, the gradient through
them, and the refusals before any model loads. Whole runs against bf16: tests/integration/test_train_fp8.py."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from torchao.float8.float8_linear import Float8Linear

from stk.errors import InputError
from stk.models import Family, build_tiny_model
from stk.train.objective.objectives import objective_for
from stk.train.trainable import fp8


def test_the_repeated_blocks_linear_layers_multiply_in_float8_and_the_rest_stay(tmp_path: Path):
    model = build_tiny_model(Family.FLUX, str(tmp_path / "model"))
    denoiser = objective_for(Family.FLUX, model).load_denoiser(torch.float32)
    outside = {name for name, layer in denoiser.named_modules() if isinstance(layer, torch.nn.Linear)}
    names_before = dict(denoiser.named_parameters())
    swapped = fp8.convert(denoiser)

    floated = {name for name, layer in denoiser.named_modules() if isinstance(layer, Float8Linear)}
    assert swapped == len(floated) > 0
    assert all(name.startswith(("transformer_blocks.", "single_transformer_blocks.")) for name in floated)
    assert {"x_embedder", "proj_out"} <= outside - floated  # embeddings and the final projection stay
    assert dict(denoiser.named_parameters()) == names_before  # the same parameters under the same names


def test_a_float8_layer_passes_the_gradient_on_to_float8_rounding():
    torch.manual_seed(0)
    block = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 24))])
    reference = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 24))])
    reference.load_state_dict(block.state_dict())
    model = torch.nn.Sequential()
    model.blocks = block
    assert fp8.convert(model) == 1  # 24 output features: not a multiple of 16, stays
    x = torch.randn(32, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    block[0](x).square().sum().backward()
    reference[0](x_ref).square().sum().backward()
    assert x.grad is not None and x_ref.grad is not None
    error = (x.grad - x_ref.grad).norm() / x_ref.grad.norm()
    assert 0 < error < 0.1, error  # float8's rounding (3 mantissa bits), not another function
    assert isinstance(block[0][0], Float8Linear) and not isinstance(block[0][1], Float8Linear)


def test_a_quantised_base_is_refused_in_one_line():
    with pytest.raises(InputError, match=r"--fp8-matmuls multiplies .* --base-precision int8 holds them") as raised:
        fp8.check(True, "int8")
    assert "\n" not in str(raised.value)
    fp8.check(True, "bf16")  # the CPU runs float8 matmuls (slowly)
    fp8.check(False, "fp8")


def test_a_gpu_without_float8_units_is_named():
    """No GPU here: torch.cuda answers as on an A100 (compute capability 8.0)."""
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)),
        mock.patch("torch.cuda.get_device_name", return_value="NVIDIA A100-SXM4-80GB"),
        pytest.raises(InputError, match=r"compute capability 8\.9 or later") as raised,
    ):
        fp8.check(True, "bf16")
    assert "NVIDIA A100-SXM4-80GB has 8.0: leave it out" in str(raised.value)
