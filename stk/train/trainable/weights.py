"""The denoiser's weights into host memory once, in the training dtype, never whole on a rank under ZeRO-3.

diffusers' from_pretrained maps a safetensors file and casts it: when the file's dtype is the training dtype the
weights stay file-backed (nothing copied), but SDXL's UNet ships in fp32, so a bf16 run touches the whole fp32 file
and holds its bf16 copy beside it: about 3x the bf16 size per rank, times 8 ranks a node. Here the model is built
without weights (on the meta device, or under DeepSpeed's zero.Init so that each rank allocates only its shard of
every parameter) and filled tensor by tensor, each cast as it is read. The file's mapping is dropped every
READ_WINDOW bytes so that the pages already copied leave the process too.

Under ZeRO-3 only rank 0 reads the parameters: each layer is gathered in turn (deepspeed.zero.GatheredParameters),
rank 0 copies its tensors in, and DeepSpeed partitions it again across the ranks. Persistent buffers (SD3's position
table) are not partitioned: every rank reads its own.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stk.cluster.world import World
from stk.errors import InputError

__all__ = ["READ_WINDOW", "load_weights", "load_weights_partitioned"]

READ_WINDOW = 128 * 2**20  # bytes read through one mapping of a weights file before it is mapped afresh


class _Reader:
    """Tensors by name from safetensors files, each file mapped afresh after READ_WINDOW bytes."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._open = lambda path: safe_open(str(path), framework="pt", device="cpu")
        self.folder = files[0].parent
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in files:
            try:
                with self._open(path) as handle:
                    for name in handle.keys():  # noqa: SIM118  (safe_open is not a mapping)
                        self.where[name] = path
                        self.shapes[name] = tuple(handle.get_slice(name).get_shape())
            except Exception as exc:  # safetensors' own error type for a damaged header
                raise InputError(f"cannot load {path}: {str(exc).strip().splitlines()[0]}") from exc
        self._handles: dict[Path, Any] = {}
        self._read = 0

    def get(self, name: str) -> torch.Tensor:
        path = self.where[name]
        if path not in self._handles:
            self._handles[path] = self._open(path)
        tensor: torch.Tensor = self._handles[path].get_tensor(name)
        self._read += tensor.nbytes
        if self._read >= READ_WINDOW:
            self._handles.clear()  # unmaps: the pages read so far no longer count against this process
            self._read = 0
        return tensor


def _release_freed_memory() -> None:
    """Hand freed heap back to the system. glibc keeps it for reuse, so each layer gathered and dropped would stay
    in this rank's RSS (and a node's 8 ranks share its RAM); malloc_trim returns it. Nothing to do without glibc."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint holds beside the parameters (SD3's position table), by their names there."""
    return {
        f"{prefix}.{name}" if prefix else name: buffer
        for prefix, layer in module.named_modules()
        for name, buffer in layer.named_buffers(recurse=False)
        if name not in layer._non_persistent_buffers_set
    }


def _check_names(module: torch.nn.Module, reader: _Reader) -> None:
    """InputError unless the files hold exactly the module's tensors (parameters and persistent buffers), each in its
    shape."""
    tensors = {**dict(module.named_parameters()), **_persistent_buffers(module)}
    expected = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in tensors.items()}
    missing, unexpected = sorted(expected.keys() - reader.shapes.keys()), sorted(reader.shapes.keys() - expected.keys())
    reshaped = sorted(k for k in expected.keys() & reader.shapes.keys() if expected[k] != reader.shapes[k])
    if missing or unexpected or reshaped:
        kinds = (("missing", missing), ("unexpected", unexpected), ("of another shape", reshaped))
        found = [f"{len(names)} {what}, e.g. {names[0]}" for what, names in kinds if names]
        raise InputError(f"{reader.folder}: the weights do not fit the config ({'; '.join(found)})")


def load_weights(
    denoiser_class: type[Any],
    config: dict[str, Any],
    files: list[Path],
    dtype: torch.dtype,
    on_layer: Callable[[torch.nn.Module], None] | None = None,
) -> Any:
    """The denoiser of `config` with the weights in `files` (weight_files), in `dtype`. `on_layer` is called with each
    layer as soon as all of its own tensors are filled (stk.train.trainable.baseprecision quantises it there), and the
    memory it frees is handed back, so the layers read so far never stay whole in `dtype`. Then every tensor is copied
    out of the file's mapping: one left mapped (a bias beside a quantised weight) keeps the file's pages read so far in
    the process, the whole file once every layer was read."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    with init_empty_weights():
        module = denoiser_class.from_config(config)
    reader = _Reader(files)
    _check_names(module, reader)
    unfilled = Counter(name.rpartition(".")[0] for name in reader.where)
    for name in list(reader.where):
        value = reader.get(name).to(dtype, copy=on_layer is not None)
        set_module_tensor_to_device(module, name, "cpu", value=value, dtype=dtype)
        owner = name.rpartition(".")[0]
        unfilled[owner] -= 1
        if on_layer is not None and not unfilled[owner]:
            on_layer(module.get_submodule(owner))
            _release_freed_memory()
    _release_freed_memory()  # the tensors read in the file's dtype, before the cast
    return module


def load_weights_partitioned(
    denoiser_class: type[Any],
    config: dict[str, Any],
    files: list[Path],
    world: World,
    deepspeed_config: dict[str, Any],
) -> Any:
    """load_weights for ZeRO-3: built under zero.Init with the run's DeepSpeed config, so each rank allocates only
    its shard of each parameter, in the config's precision; only rank 0 reads parameters. Collective: every rank
    calls it."""
    import deepspeed

    # The dtype follows the config's bf16 section (DeepSpeed 0.19 ignores its dtype argument where the accelerator
    # lacks fp16, as the CPU does). The config's memory_efficient_linear (DeepSpeed's default: true) decides whether
    # torch's linear is replaced for the rest of the process, whatever the argument says: the zero3 preset sets it
    # false, since the replacement splits each linear into a matmul and an add, two ops for one.
    with deepspeed.zero.Init(config_dict_or_path=deepspeed_config):
        module = denoiser_class.from_config(config)
    _release_freed_memory()  # each layer was made whole, then partitioned
    reader: _Reader | None = None

    def open_files() -> None:  # on rank 0; its errors are raised on every rank
        nonlocal reader
        reader = _Reader(files)
        _check_names(module, reader)

    world.root_call(open_files)
    for prefix, layer in module.named_modules():
        params = list(layer.named_parameters(recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
            if reader is not None:
                for name, param in params:
                    param.data.copy_(reader.get(f"{prefix}.{name}" if prefix else name))
        _release_freed_memory()
    buffers = _persistent_buffers(module)
    if buffers:  # not partitioned: every rank reads its own copy (the files' pages are shared on a node)
        own = reader or _Reader(files)
        for name, buffer in buffers.items():
            buffer.data.copy_(own.get(name))
    return module
