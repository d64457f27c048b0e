"""--fp8-matmuls: the linear layers of the denoiser's repeated blocks multiply in float8, forward and backward
(torchao's float8 training, `Float8Linear`: each input, weight and output gradient scaled to e4m3/e5m2 per tensor
as it is used, the weights themselves kept and trained in the training dtype).

Hopper's float8 units do a matmul in about half a bf16 matmul's time, and the repeated blocks' linear layers are
most of a transformer denoiser's work; the layers outside them (embeddings, the final projection) stay in the
training dtype, as torchtitan's recipe keeps its output layer, and so do layers whose sides are not multiples of 16
(torch._scaled_mm's requirement). A full fine-tune trains the weights as ever; under an adapter the frozen base
multiplies in float8 and its input gradient reaches the adapters (torchao also forms the frozen weight's gradient,
which autograd then drops). Names, state_dict and checkpoints are those of the linear layers, so export and resume
are unchanged; torch.compile fuses the scaling casts into the neighbouring kernels (--compile).

Refused in one line before any model loads: a GPU below compute capability 8.9 (naming it), and a quantised base
(--base-precision int8/fp8 holds its weights in torchao's own tensors). The CPU runs torch._scaled_mm too, slowly:
for checks, not speed.
"""

from __future__ import annotations

import torch

from stk.errors import InputError
from stk.log import get_logger
from stk.train.trainable.baseprecision import check_fp8_gpu
from stk.train.trainable.flatweights import block_prefixes

__all__ = ["check", "convert"]

log = get_logger("train.fp8")

FLAG = "--fp8-matmuls"
SIDE_MULTIPLE = 16  # torch._scaled_mm's: both sides of a float8 matmul's weight


def check(fp8_matmuls: bool, base_precision: str) -> None:
    """InputError for --fp8-matmuls where this run cannot take it; every rank, before any model loads."""
    if not fp8_matmuls:
        return
    if base_precision != "bf16":
        raise InputError(
            f"{FLAG} multiplies the base's weights as they are trained, and --base-precision {base_precision} holds "
            "them quantised: give one of the two"
        )
    if torch.cuda.is_available():
        check_fp8_gpu(FLAG, "leave it out")


def convert(denoiser: torch.nn.Module) -> int:
    """Swap the linear layers of the denoiser's repeated blocks for torchao's Float8Linear, in place (the same
    parameters); the number swapped."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    blocks = block_prefixes(denoiser)
    swapped: list[str] = []

    def chosen(layer: torch.nn.Module, name: str) -> bool:
        if not (isinstance(layer, torch.nn.Linear) and name.startswith(blocks)):
            return False
        if layer.in_features % SIDE_MULTIPLE or layer.out_features % SIDE_MULTIPLE:
            return False
        swapped.append(name)
        return True

    convert_to_float8_training(denoiser, module_filter_fn=chosen, config=Float8LinearConfig())
    linears = sum(isinstance(layer, torch.nn.Linear) for layer in denoiser.modules())
    log.info("%s: %d of the denoiser's %d linear layers multiply in float8", FLAG, len(swapped), linears)
    return len(swapped)
