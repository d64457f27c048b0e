"""stk-train's options for training an adapter (LoRA, DoRA, LoHa, LoKr) on a frozen, maybe quantised, model."""

from __future__ import annotations

import click

from stk.cli.common import FiniteFloat, default_of, option_group
from stk.train.options import TrainOptions
from stk.train.trainable.baseprecision import BASE_PRECISIONS
from stk.train.trainable.lora import ADAPTERS, LoraSettings

__all__ = ["adapter_options"]


# The adapter, its shape and targets, and the frozen base's precision.
adapter_options = option_group(
    click.option(
        "--lora-rank",
        default=default_of(LoraSettings, "rank"),
        type=int,
        show_envvar=True,
        help="Train an adapter (--adapter) of this rank on the frozen model instead of every weight (0: full "
        "fine-tune). LoRA: the inner width of its two factors; LoHa: that of each of its two pairs of "
        "factors; LoKr: that of the Kronecker product's second factor (a full matrix where the rank is at "
        "least half its side). OUTPUT/final and each checkpoint's lora/ then hold the adapter.",
    ),
    click.option(
        "--adapter",
        type=click.Choice(ADAPTERS),
        default=default_of(LoraSettings, "adapter"),
        show_envvar=True,
        help="lora: pytorch_lora_weights.safetensors, for pipe.load_lora_weights. loha, lokr (LyCORIS, through "
        "peft): adapter_config.json and adapter_model.safetensors, for peft's PeftModel.from_pretrained "
        "on the pipeline's denoiser (load_lora_weights does not read them).",
    ),
    click.option(
        "--dora",
        is_flag=True,
        show_envvar=True,
        help="With --adapter lora: DoRA (peft's use_dora), the weights' magnitude trained apart from their "
        "direction; saved as a LoRA is, for pipe.load_lora_weights.",
    ),
    click.option(
        "--lora-alpha",
        default=None,
        type=int,
        show_envvar=True,
        help="Each --adapter's update is scaled by alpha / rank [default: the rank].",
    ),
    click.option(
        "--lora-dropout",
        default=default_of(LoraSettings, "dropout"),
        type=FiniteFloat(),
        show_envvar=True,
        help="LoRA: dropout on the adapter's input. LoHa, LoKr: peft's rank dropout, rows of the weight "
        "update dropped. Training only.",
    ),
    click.option(
        "--lora-targets",
        default=None,
        show_envvar=True,
        help="Comma list of the layers to adapt (for each --adapter), each by its name or the end of it "
        "(to_q,to_v) [default: the attention projections; for Flux also its feed-forward "
        "layers].",
    ),
    click.option(
        "--base-precision",
        type=click.Choice(BASE_PRECISIONS),
        default=default_of(TrainOptions, "base_precision"),
        show_envvar=True,
        help="With an adapter: hold the frozen model's linear layers in 8 bits, quantised as they load "
        "(torchao), about half the memory of the base on every rank; int8 on any device (slower steps "
        "on a CPU), fp8 on GPUs of compute capability 8.9+ (H100). bf16: not quantised, the training "
        "dtype. Not with full fine-tuning or ZeRO-3; resume keeps it.",
    ),
)
