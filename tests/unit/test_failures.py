"""stk.failures: which failure an exception is (the GPU, no memory, a peer gone), and the one line each gives."""

from __future__ import annotations

import torch

from stk.errors import ExitCode
from stk.failures import is_gpu_error, is_out_of_memory, is_peer_failure, out_of_memory, peer_failed

GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:37091: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)


def test_gpu_errors_are_told_from_code_errors():
    assert is_gpu_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_gpu_error(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled system error"))
    assert not is_gpu_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_gpu_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_gpu_error(ValueError("CUDA error"))


def test_out_of_memory_on_the_gpu_or_the_host_is_one_line_about_the_batch():
    cuda = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.25 GiB "
        "is free.\nIncluding non-PyTorch memory, this process has 77.8 GiB memory in use."
    )
    try:
        torch.empty(1 << 50, dtype=torch.uint8)  # the CPU allocator refuses 1 PiB with a RuntimeError
    except RuntimeError as exc:
        host = exc
    for exc, where, detail in (
        (cuda, "GPU", "CUDA out of memory. Tried to allocate 2.00 GiB"),
        (host, "host", "DefaultCPUAllocator: can't allocate memory"),
    ):
        assert is_out_of_memory(exc) and not is_gpu_error(exc)
        error = out_of_memory(exc, 16)
        message = str(error)
        assert error.exit_code == 3 and "\n" not in message
        assert message.startswith(f"out of {where} memory at --batch-size 16: {detail}"), message
        assert "--grad-accum" in message and "--lora-rank" in message
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_a_peer_that_went_away_is_infra_in_one_line_not_a_gpu_fault_or_a_bug():
    timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation")
    assert is_peer_failure(RuntimeError(GLOO_RESET)) and is_peer_failure(timeout)
    nccl = torch.distributed.DistBackendError("NCCL error: remote process exited or there was a network error")
    assert is_peer_failure(nccl)
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    error = peer_failed(RuntimeError(GLOO_RESET), 0, "node1", 15)
    assert error.exit_code == ExitCode.INFRA
    assert str(error).startswith("rank 0 on node1: a peer rank failed, stopped answering or was cut off: Read error ")
    assert "Connection reset by peer;" in str(error) and "GLHF" not in str(error) and "\n" not in str(error)
    assert "(no answer within --collective-timeout 15 s)" in str(peer_failed(timeout, 1, "node2", 15))
