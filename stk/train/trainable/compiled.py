"""--compile: the denoiser's repeated blocks compiled by torch.compile (regional compilation), the rest eager.

A denoiser is dozens of copies of one or two blocks. Compiling each block's forward, not the whole model, traces one
graph per block class and reuses it for every copy, so a compile takes seconds where the whole model's takes
minutes; DeepSpeed's hooks, gradient checkpointing and the flat weights' rebinding stay outside the graphs, eager, so
every preset, adapter and resume works as it does uncompiled. A new bucket's shape recompiles the block once, with
its sizes dynamic from then on (torch.compile's default), so a run of many buckets compiles each block about twice.

The generated code is kept in OUTPUT/compile-cache, on the job's shared storage: a resumed or repeated run loads it
instead of compiling. A block that fails to compile (a compiler error, a missing header) turns every block back to
eager with one warning line; nothing waits on another rank, so no rank hangs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from stk.errors import InputError
from stk.log import get_logger
from stk.train.trainable.flatweights import repeated_blocks

__all__ = ["CACHE_DIR", "check_compiler", "compile_blocks"]

log = get_logger("train.compile")

CACHE_DIR = "compile-cache"  # under --output-dir


def check_compiler(mode: str | None) -> None:
    """InputError (exit 3) where torch.compile cannot generate code on this machine: Triton for a GPU, a C++
    compiler for the CPU. Before any weight loads."""
    if mode is None:
        return
    if torch.cuda.is_available():
        from torch.utils._triton import has_triton

        if not has_triton():
            raise InputError(f"--compile {mode}: torch.compile needs Triton on a GPU (pip install triton)")
        return
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        cxx = os.environ.get("CXX", "g++")
        raise InputError(
            f"--compile {mode}: torch.compile needs a C++ compiler on the CPU and found none ({cxx}): install g++ "
            "or set CXX, or leave --compile out"
        ) from None


def compile_blocks(denoiser: torch.nn.Module, mode: str, output_dir: str) -> int:
    """Compile each of the denoiser's repeated blocks' forward with `mode`, the generated code cached in
    OUTPUT/compile-cache; the number of blocks compiled."""
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(output_dir, CACHE_DIR)  # read at each compile
    blocks = repeated_blocks(denoiser)
    regions = _Regions(mode)
    for _, block in blocks:
        regions.add(block)
    kinds = sorted({type(block).__name__ for _, block in blocks})
    log.info("--compile %s: %d blocks (%s), code cached in %s", mode, len(blocks), ", ".join(kinds), cache)
    return len(blocks)


class _Regions:
    """The compiled blocks of one denoiser, all turned back to eager at the first that fails to compile."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.eager = False

    def add(self, block: torch.nn.Module) -> None:
        eager = block.forward
        compiled = torch.compile(eager, mode=self.mode)
        block.forward = self._either(compiled, eager, type(block).__name__)

    def _either(self, compiled: Callable[..., Any], eager: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.eager:
                try:
                    return compiled(*args, **kwargs)
                except torch._dynamo.exc.TorchDynamoException as exc:  # an error of the model's own math reaches eager
                    self.eager = True
                    reason = (str(exc).strip() or type(exc).__name__).splitlines()[0][:300]
                    log.warning("--compile: %s failed to compile (%s); the run goes on eager", kind, reason)
            return eager(*args, **kwargs)

        return forward
