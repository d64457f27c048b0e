"""--base-precision: the frozen denoiser of an adapter run held in 8 bits through torchao, so that every rank holds
about half the bytes of a bf16 base under ZeRO 1/2 (the base is not partitioned there).

Each linear layer is quantised as soon as its tensors are read (stk.train.trainable.weights calls the hook `quantizer`
gives), so the base never exists whole in the training dtype. int8 is torchao's weight-only int8 with a scale per output
row: pure PyTorch, on any device. fp8 is torchao's weight-only float8 (e4m3, per row), refused below compute capability
8.9. Both dequantise for the matmul, so the gradient reaches the adapters of earlier layers through the input; fp8
matmuls proper (torchao's dynamic-activation config) would not: torch._scaled_mm has no derivative (torch 2.13). Only
linear layers are quantised: the convolutions of SD/SDXL's UNet stay in the training dtype.

Refused before any model loads: a quantised base without an adapter (full fine-tuning trains the base), and ZeRO-3,
which partitions parameters by their storage and cannot take torchao's tensors (DeepSpeed 0.19).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from stk.errors import InputError

__all__ = ["BASE_PRECISIONS", "FP8_CAPABILITY", "check", "check_fp8_gpu", "quantize_layer", "quantizer"]

BASE_PRECISIONS = ("bf16", "int8", "fp8")  # bf16: not quantised, the training dtype (fp32 with --precision fp32)
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 units


def check(base_precision: str, adapter: bool, zero_stage: int) -> None:
    """InputError for a base precision this run cannot take; every rank, before any model loads."""
    if base_precision not in BASE_PRECISIONS:
        raise InputError(f"--base-precision {base_precision}: give one of {', '.join(BASE_PRECISIONS)}")
    if base_precision == "bf16":
        return
    flag = f"--base-precision {base_precision}"
    if not adapter:
        raise InputError(
            f"{flag} quantises the frozen base of an adapter: add --lora-rank, or drop it to train every weight"
        )
    if zero_stage == 3:
        raise InputError(
            f"{flag}: ZeRO-3 cannot partition torchao's quantised weights; use --deepspeed zero2 or "
            "zero1, where every rank holds the quantised base whole"
        )
    if base_precision == "fp8":
        _check_fp8_device()


def _check_fp8_device() -> None:
    if not torch.cuda.is_available():
        raise InputError(
            "--base-precision fp8 needs a GPU of compute capability 8.9 or later (H100, L40S, "
            "RTX 4090); this machine has none (cpu): use int8"
        )
    check_fp8_gpu("--base-precision fp8", "use int8")


def check_fp8_gpu(flag: str, instead: str) -> None:
    """InputError, naming the device, where this machine's GPU predates float8 units (compute capability below
    8.9)."""
    capability = torch.cuda.get_device_capability(0)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(0)
        raise InputError(
            f"{flag} needs a GPU of compute capability 8.9 or later (H100, L40S, RTX 4090); {name} has "
            f"{capability[0]}.{capability[1]}: {instead}"
        )


def _config(base_precision: str) -> Any:
    """torchao's config; set_inductor_config=False: otherwise quantize_ changes torch.compile's global settings."""
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, PerRow

    if base_precision == "int8":
        return Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
    return Float8WeightOnlyConfig(set_inductor_config=False)


def quantize_layer(layer: torch.nn.Module, config: Any) -> None:
    """Quantise `layer` in place when it is a linear layer (torchao's `quantize_` with `config`); others stay.

    The quantised weight is held as a non-persistent buffer, not a parameter, because DeepSpeed 0.19 cannot take
    torchao's tensors as parameters: it keeps a weak reference to every parameter and then moves the module with
    `.to()`, which replaces a tensor subclass by `torch.utils.swap_tensors` and refuses while a weak reference
    exists; and it broadcasts parameters from rank 0 as bytes (`view(torch.uint8)`), which torchao's tensors do not
    implement. The linear layer reads `self.weight` either way; the frozen base stays out of every checkpoint (it is
    --model's, loaded again on resume)."""
    from torchao.quantization import quantize_

    if not isinstance(layer, torch.nn.Linear):
        return
    quantize_(layer, config)
    weight = layer.weight.detach()
    del layer.weight
    layer.register_buffer("weight", weight, persistent=False)


def quantizer(base_precision: str) -> Any:
    """The per-layer hook of stk.train.trainable.weights.load_weights for `base_precision`; None when not quantised."""
    if base_precision == "bf16":
        return None
    # peft's torchao LoRA layer warns, once per run, that it cannot merge without a requantising function: stk
    # never merges (the adapter is saved apart from the base)
    warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated without", category=UserWarning)
    config = _config(base_precision)
    return lambda layer: quantize_layer(layer, config)
