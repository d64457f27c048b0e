"""stk-train's options for how the denoiser computes: compiled blocks, recomputed activations, float8 matmuls."""

from __future__ import annotations

import click

from stk.cli.common import default_of, option_group
from stk.train.options import TrainOptions

__all__ = ["compile_options", "fp8_option"]


# torch.compile and gradient checkpointing: speed and memory, the same math.
compile_options = option_group(
    click.option(
        "--compile",
        "compile_mode",
        default=None,
        show_envvar=True,
        type=click.Choice(["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]),
        help="torch.compile each of the denoiser's repeated blocks in this mode, the code kept in "
        "OUTPUT/compile-cache for a resumed run; a block that fails to compile trains eager [default: "
        "eager].",
    ),
    click.option(
        "--gradient-checkpointing/--no-gradient-checkpointing",
        default=default_of(TrainOptions, "gradient_checkpointing"),
        show_envvar=True,
        help="Recompute the denoiser's activations in the backward pass instead of keeping them: far less "
        "memory, one more forward pass of each block, the same math.",
    ),
)


# Float8 matmuls in the repeated blocks.
fp8_option = option_group(
    click.option(
        "--fp8-matmuls",
        is_flag=True,
        show_envvar=True,
        help="The linear layers of the denoiser's repeated blocks multiply in float8, forward and backward (torchao's "
        "float8 training; the weights trained in the training dtype): full fine-tuning or the frozen base of an "
        "adapter, on GPUs of compute capability 8.9+ (H100); best with --compile. Not with --base-precision "
        "int8/fp8; resume keeps it.",
    ),
)
