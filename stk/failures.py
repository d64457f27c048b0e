"""What kind of failure an exception is, and the one line that tells a person so: a peer rank that died or stopped
answering, a device or host out of memory, a failing GPU or fabric. stk-train and stk-cache both classify their
failures by these (a retry elsewhere, a smaller batch, a drained node)."""

from __future__ import annotations

import re

import torch

from stk.errors import InfraError, InputError

__all__ = ["is_gpu_error", "is_out_of_memory", "is_peer_failure", "out_of_memory", "peer_failed"]

# What a collective raises when a peer rank died (its sockets closed or reset) or stopped answering
# (the process group's timeout): gloo's transport messages, and NCCL's for a peer that exited.
PEER_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Software caused connection abort",  # this rank's side of a connection to a peer torn down
    "Broken pipe",
    "Timed out waiting",
    "remote process exited",
    "Watchdog caught collective operation timeout",
)


def is_peer_failure(exc: BaseException) -> bool:
    """A collective that failed because of another rank: it died, its socket was reset, or it did
    not answer within the collective timeout. Checked before is_gpu_error: NCCL reports a dead
    peer as an NCCL error, which is no fault of this rank's GPU."""
    return isinstance(exc, (RuntimeError, ConnectionError)) and any(m in str(exc) for m in PEER_MARKERS)


def peer_failed(exc: BaseException, rank: int, node: str, timeout_s: float) -> InfraError:
    """The one line for a peer failure. This rank only knows that the peer went away: the peer's
    own reason, if it lived to give one, is in its log lines."""
    text = str(exc)
    # gloo's "[.../pair.cc:598] Read error [addr]:port: Connection reset by peer. This is typically ..."
    detail = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0]).split(". ")[0]
    waited = f" (no answer within --collective-timeout {timeout_s:g} s)" if "Timed out" in text else ""
    return InfraError(
        f"rank {rank} on {node}: a peer rank failed, stopped answering or was cut off{waited}: {detail}; look "
        "for its reason in its own log lines; rerun the same command to resume from the last checkpoint"
    )


def is_out_of_memory(exc: BaseException) -> bool:
    """The device (CUDA) or the host (the CPU allocator, which raises a RuntimeError) had no room."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)
    )


def out_of_memory(exc: BaseException, batch_size: int) -> InputError:
    """The one line for a run that does not fit: what ran out, and the settings that use less."""
    where = "GPU" if isinstance(exc, torch.OutOfMemoryError) else "host"
    # "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..." / "[enforce fail at alloc_cpu.cpp:127]
    # err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes. Error code 12 ..."
    text = re.sub(r"^\[[^\]]*\]\s*err == 0\.\s*", "", str(exc).strip())
    detail = ". ".join(text.splitlines()[0].split(". ")[:2]).rstrip(".") if text else type(exc).__name__
    return InputError(
        f"out of {where} memory at --batch-size {batch_size}: {detail}; use less: a smaller "
        "--batch-size (with --grad-accum to keep the effective batch), --gradient-checkpointing, a LoRA "
        "(--lora-rank), or a preset that shards more (--deepspeed zero2, zero3)"
    )


def is_gpu_error(exc: BaseException) -> bool:
    """A CUDA or NCCL failure in the step: the device or the fabric, not the training code.
    Out of memory is the code's (batch size), not the GPU's."""
    if is_out_of_memory(exc):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    if isinstance(exc, torch.distributed.DistBackendError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "NCCL error", "ECC error")
    )
