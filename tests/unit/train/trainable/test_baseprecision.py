"""--base-precision (stk.train.trainable.baseprecision): the refusals before any model loads, a linear layer quantised
to int8 at about half its bytes with the gradient still reaching its input, and an adapter trained on an int8 base that
the family's pipeline loads with load_lora_weights over its unquantised weights. The loss curve against bf16 and the
resume refusal: tests/integration/test_train_lora.py; the layer-by-layer load: test_weights.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft.utils import get_peft_model_state_dict
from support.lora_files import assert_pipeline_loads_it, saved_lora
from torchao.utils import get_model_size_in_bytes

from stk.errors import InputError
from stk.models import Family, build_tiny_model
from stk.train.trainable.baseprecision import check, quantizer

REFUSED = {
    "without an adapter": (("int8", False, 2), "--base-precision int8 quantises the frozen base of an adapter"),
    "fp8 without an adapter": (("fp8", False, 1), "add --lora-rank, or drop it to train every weight"),
    "under ZeRO-3": (("int8", True, 3), "--base-precision int8: ZeRO-3 cannot partition torchao's quantised weights"),
    "unknown": (("int4", True, 2), "--base-precision int4: give one of bf16, int8, fp8"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_base_precision_this_run_cannot_take_is_one_line(case):
    args, message = REFUSED[case]
    with pytest.raises(InputError, match=message) as raised:
        check(*args)
    assert "\n" not in str(raised.value)


def test_what_every_run_can_take_passes():
    check("bf16", adapter=False, zero_stage=3)  # not quantised: any run
    check("int8", adapter=True, zero_stage=2)
    assert quantizer("bf16") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="names the CPU as the device without fp8")
def test_fp8_without_a_gpu_names_the_device():
    with pytest.raises(InputError, match=r"fp8 needs a GPU of compute capability 8\.9.*has none \(cpu\): use int8"):
        check("fp8", adapter=True, zero_stage=2)


def test_an_int8_linear_layer_holds_half_the_bytes_and_passes_the_gradient_on():
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 256).to(torch.bfloat16)
    held = torch.nn.Sequential(layer)  # get_model_size_in_bytes counts a module's children
    plain = get_model_size_in_bytes(held)
    x = torch.randn(4, 512, dtype=torch.bfloat16, requires_grad=True)
    expected = layer(x)
    quantise = quantizer("int8")
    quantise(layer)
    # a buffer outside the checkpoints, not a parameter (DeepSpeed cannot take torchao's tensors as parameters)
    assert type(layer.weight).__name__ == "Int8Tensor" and not layer.weight.requires_grad
    assert [name for name, _ in layer.named_parameters()] == ["bias"] and "weight" not in layer.state_dict()
    # int8 data, a float32 scale and an int8 zero point per row, the bias as it was
    assert get_model_size_in_bytes(held) == 256 * 512 + 256 * (4 + 1) + 256 * 2
    assert 0.49 < get_model_size_in_bytes(held) / plain < 0.52
    out = layer(x)
    torch.testing.assert_close(out, expected, rtol=0.05, atol=0.05)
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    norm = torch.nn.LayerNorm(8)
    quantise(norm)  # not a linear layer: left as it is
    assert isinstance(norm.weight, torch.nn.Parameter)


def test_an_adapter_trained_on_an_int8_base_loads_into_the_pipeline(tmp_path: Path):
    """peft wraps the quantised layers in its own torchao LoRA layer under the same names, so the file stk writes holds
    the same keys as on a bf16 base, and the pipeline's load_lora_weights puts them over its unquantised weights."""
    model = build_tiny_model(Family.FLUX, str(tmp_path / "flux"))
    trained = saved_lora(Family.FLUX, model, tmp_path / "lora", base_precision="int8")
    assert any(type(b).__name__ == "Int8Tensor" for b in trained.buffers())
    g = torch.Generator().manual_seed(2)
    assert_pipeline_loads_it(
        Family.FLUX,
        model,
        tmp_path / "lora",
        trained,
        rtol=0.05,
        atol=0.05,
        hidden_states=torch.randn(1, 12, 64, generator=g),
        encoder_hidden_states=torch.randn(1, 5, 48, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g),
        timestep=torch.tensor([0.4]),
        guidance=torch.tensor([3.5]),
        txt_ids=torch.zeros(5, 3),
        img_ids=torch.zeros(12, 3),
    )
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(model)
    pipe.load_lora_weights(tmp_path / "lora")
    (adapter,) = pipe.transformer.peft_config
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=adapter)
    saved = get_peft_model_state_dict(trained)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
