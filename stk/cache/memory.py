"""Whether a model's encoders fit the device before they load, and how much memory the text pass took.

An LLM text encoder is tens of GB (Mistral-Small-3's 24B parameters: 48 GB in bf16). Its size is read from the
checkpoint's safetensors headers (no weights are read) and compared with the device's free memory, so a job that
cannot fit ends in seconds with the fix (`--two-pass`: one model on the device at a time) instead of an
out-of-memory error minutes into the load.
"""

from __future__ import annotations

import json
import resource
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from stk.errors import InputError
from stk.log import get_logger
from stk.models.model_json import read_model_json
from stk.models.weightfiles import component_folder, weight_files

__all__ = ["Footprint", "TextPass", "check_fits", "fit_problem", "footprint", "free_memory", "load_failure", "measured"]

log = get_logger("cache")

GB = 1e9
# The share of the free memory the weights may take: the rest is for activations (a batch's hidden states).
WEIGHTS_SHARE = 0.9
TWO_PASS = "--two-pass"


@dataclass(frozen=True)
class Footprint:
    """Bytes the weights take on the device, in the dtype they are loaded in."""

    text: int  # every text encoder together
    vae: int


def _safetensors_parameters(path: Path) -> int:
    """The parameters in a .safetensors file, from its header (an 8-byte length, then JSON): no tensor is read.
    Read here rather than through safetensors' safe_open, which maps the whole file first: a check of whether a
    model fits must not need the address space the model would."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    total = 0
    for name, entry in header.items():
        if name != "__metadata__":
            count = 1
            for dim in entry["shape"]:
                count *= dim
            total += count
    return total


def _component_bytes(model: str, subfolder: str, itemsize: int) -> int | None:
    """Weights of one component at `itemsize` bytes a parameter, from its safetensors files' headers; None when it
    has none on this machine (the load says why, or loads other files)."""
    folder = component_folder(model, subfolder)
    files = weight_files(folder) if folder is not None else None
    return None if files is None else sum(_safetensors_parameters(p) for p in files) * itemsize


def footprint(model: str, dtype: torch.dtype) -> Footprint | None:
    """The text encoders' (each `text_encoder*` component of model_index.json) and the VAE's weights in `dtype`,
    from their files; None where a component has no safetensors files here."""
    index = read_model_json(model, "model_index.json")
    names = [name for name, value in index.items() if name.startswith("text_encoder") and value and value[0]]
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [_component_bytes(model, name, itemsize) for name in [*sorted(names), "vae"]]
    if any(size is None for size in sizes):
        return None
    known = [size or 0 for size in sizes]
    return Footprint(sum(known[:-1]), known[-1])


def _cgroup_free() -> int | None:
    """What this process's cgroup (v2) still allows, where it sets a limit: Slurm confines a job so."""
    base = Path("/sys/fs/cgroup")
    try:
        relative = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        limit = (base / relative.lstrip("/") / "memory.max").read_text().strip()
        used = (base / relative.lstrip("/") / "memory.current").read_text().strip()
    except (OSError, IndexError):
        return None
    return None if limit == "max" else max(0, int(limit) - int(used))


def free_memory(device: torch.device) -> int | None:
    """Bytes free for new weights: the GPU's free memory on CUDA; on the CPU the host's available memory
    (MemAvailable), or less where the job's cgroup allows less; None where not known (another device)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    available = None
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    confined = _cgroup_free()
    known = [n for n in (available, confined) if n is not None]
    return min(known) if known else None


def fit_problem(need: Footprint, free: int, two_pass: bool, device: str) -> str | None:
    """Why the encoders cannot load on `device` with `free` bytes free, naming the text encoders' size and the fix;
    None when they fit. One pass holds the text encoders and the VAE together on the device, two passes one at a
    time (on the CPU both sit in host memory either way); the weights may take WEIGHTS_SHARE of the free memory,
    the rest is for activations."""
    room = free * WEIGHTS_SHARE
    on_host = device.startswith("cpu")
    if (max(need.text, need.vae) if two_pass and not on_host else need.text + need.vae) <= room:
        return None
    sizes = f"{need.text / GB:.1f} GB of text encoders"
    where = f"{device}, which has {free / GB:.1f} GB free"
    if on_host:
        return (
            f"{sizes} and a {need.vae / GB:.1f} GB VAE do not fit on {where}: use a host with more memory, or "
            f"fewer ranks on it ({TWO_PASS} does not help on the CPU: both stay in host memory)"
        )
    if need.text > room:
        return (
            f"{sizes} do not fit on {where}, even alone ({TWO_PASS} does not help): use a GPU with more "
            "memory, or cache on the CPU (--device cpu), slowly"
        )
    return (
        f"{sizes} and a {need.vae / GB:.1f} GB VAE do not fit together on {where}: rerun with {TWO_PASS} "
        "(the captions first with the text encoders alone on the device, then the images with the VAE alone)"
    )


def check_fits(
    model: str, device: torch.device, dtype: torch.dtype, two_pass: bool, ranks_here: int = 1
) -> Footprint | None:
    """Raise InputError (exit 3) when the encoders of `model` cannot load on `device`; returns their footprint.
    On the CPU the `ranks_here` ranks of this host load theirs into the same memory at once."""
    need = footprint(model, dtype)
    free = free_memory(device)
    if need is None or free is None:
        return need
    host, where = need, str(device)
    if device.type == "cpu" and ranks_here > 1:
        host, where = Footprint(need.text * ranks_here, need.vae * ranks_here), f"cpu (for {ranks_here} ranks here)"
    problem = fit_problem(host, free, two_pass, where)
    if problem:
        raise InputError(f"{model}: {problem}")
    log.debug(
        "%s: %.1f GB of text encoders, %.2f GB VAE; %.1f GB free on %s",
        model,
        need.text / GB,
        need.vae / GB,
        free / GB,
        device,
    )
    return need


def load_failure(model: str, device: torch.device, need: Footprint | None, two_pass: bool) -> InputError:
    """The one line for an out-of-memory error while the encoders load (the check above passed, or could not run)."""
    sizes = f" ({need.text / GB:.1f} GB of text encoders, a {need.vae / GB:.1f} GB VAE)" if need else ""
    if device.type == "cpu":
        fix = "use a host with more memory, or fewer ranks on it"
    else:
        fix = "use a GPU with more memory" if two_pass else f"rerun with {TWO_PASS} (one model on the device at a time)"
    return InputError(f"{model}: out of memory on {device} while loading its encoders{sizes}: {fix}")


@dataclass
class TextPass:
    """What one rank's text pass took: seconds, and its memory peak (`peak_of` says which memory)."""

    seconds: float = 0.0
    peak_bytes: int = 0
    peak_of: str = ""


@contextmanager
def measured(device: torch.device) -> Iterator[TextPass]:
    """Time the block and its memory peak: on CUDA the most device memory allocated during it
    (torch.cuda.max_memory_allocated, the weights already there included); elsewhere the process's RSS
    high-water mark at its end (the whole process's, since it started)."""
    out = TextPass(peak_of="cuda allocated" if device.type == "cuda" else "process peak RSS")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.monotonic()
    yield out
    out.seconds = time.monotonic() - started
    if device.type == "cuda":
        out.peak_bytes = int(torch.cuda.max_memory_allocated(device))
    else:
        out.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
