"""The measuring process of bench/memory.py (--child SPEC): one configuration, one fresh process, one JSON line on
stdout: the RSS high-water mark, autograd's own count of the tensors it saves, a weight's gradient peak, step times."""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from denoisers import denoiser_of, reduced_depth, step_inputs, training_forward
from memory_common import LORA_RANK, SDXL_UNET

from stk.models.interface import StepInputs
from stk.models.published import PUBLISHED, build_published, published_config

# the full AdamW step of part 2 on a UNet that fits in RAM: same widths, one transformer layer per attention block
REDUCED_SDXL_UNET = {**SDXL_UNET, "transformer_layers_per_block": [1, 1, 1]}


# the UNet's modules that diffusers' enable_gradient_checkpointing checkpoints one by one, and what this script calls
# them; a transformer's blocks are the items of its top-level module lists, named after the list
UNET_BLOCKS = {"ResnetBlock2D": "resnet", "BasicTransformerBlock": "transformer"}


def block_kinds(model: torch.nn.Module) -> dict[int, str]:
    """id of each block -> its kind: the UNet's by class, a transformer's by the list that holds it."""
    kinds = {id(m): UNET_BLOCKS[type(m).__name__] for m in model.modules() if type(m).__name__ in UNET_BLOCKS}
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            kinds.update({id(block): name for block in child})
    return kinds


def status_bytes(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Start the RSS high-water mark (VmHWM) afresh at the current RSS: a build can peak above its step (SD3's
    position table is computed in float64 before it is stored in bf16), and the peak measured is the step's."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


class SavedBytes:
    """What autograd keeps for the backward pass: each storage counted once, parameters left out (they are the
    weights, not activations), by the kind of block that saved it, with the largest block instance and the largest
    single storage. Blocks are the modules diffusers checkpoints; forward hooks on them (and the checkpoint function,
    so that a checkpointed block's kept inputs count for it) say which one is running."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.by_kind: dict[str, int] = defaultdict(int)
        self.by_block: dict[int, int] = defaultdict(int)
        self.largest = 0
        self.block: tuple[str, int] = ("other", 0)
        self.kinds = block_kinds(model)
        for module in model.modules():
            if id(module) in self.kinds:
                module.register_forward_pre_hook(lambda m, _: setattr(self, "block", self._block_of(m)))
                module.register_forward_hook(lambda *_: setattr(self, "block", ("other", 0)))

    def _block_of(self, module: torch.nn.Module) -> tuple[str, int]:
        return self.kinds.get(id(module), "other"), id(module)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            kind, block = self.block
            self.by_kind[kind] += size
            if block:
                self.by_block[block] += size
            self.largest = max(self.largest, size)
        return tensor

    @contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
            yield

    def checkpoint(self, module: torch.nn.Module, *args: Any) -> Any:
        """diffusers' own checkpoint call (non-reentrant), with the block set while the checkpoint keeps its inputs."""
        previous, self.block = self.block, self._block_of(module)
        try:
            return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)
        finally:
            self.block = previous


def config_of(spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The published config a measurement runs and its denoiser config: the SDXL UNet whole (or reduced for part
    2's full AdamW step), a transformer at full width with its measured blocks (bench/denoisers.py)."""
    if spec["model"] == "sdxl-reduced":
        return "sdxl", REDUCED_SDXL_UNET
    if spec["model"] == "sdxl":
        return "sdxl", SDXL_UNET
    return spec["model"], published_config(spec["model"], "denoiser", **reduced_depth(spec["model"]))


def build_model(spec: dict[str, Any]) -> torch.nn.Module:
    """The model with random weights created directly in bf16 (a float32 build would peak at twice the bytes)."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        return build_published(config_of(spec)[1], "cpu")
    finally:
        torch.set_default_dtype(torch.float32)


def make_inputs(spec: dict[str, Any]) -> StepInputs:
    """Random latents and conditioning shaped as stk-train feeds the family, at the spec's resolution and tokens."""
    name, config = config_of(spec)
    tokens = spec.get("text_tokens", denoiser_of(name).text_tokens)
    return step_inputs(name, config, spec["resolution"], tokens, torch.bfloat16)


def train_step(spec: dict[str, Any], model: torch.nn.Module, inputs: StepInputs) -> None:
    """Forward through the family's denoise and backward of the MSE, as stk's objective does."""
    prediction, target = training_forward(config_of(spec)[0], model, inputs)
    F.mse_loss(prediction.float(), target.float()).backward()


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def weight_gradient_peak(spec: dict[str, Any]) -> dict[str, Any]:
    """The backward of the SDXL UNet's largest layer alone, on a minimal input: the bytes a weight's gradient holds
    while it is computed, the gradient memory a training step's peak can include when each is dropped as it lands."""
    torch.set_num_threads(spec["threads"])
    unet: Any = build_published(SDXL_UNET)
    kinds = (torch.nn.Conv2d, torch.nn.Linear)
    largest = max((m for m in unet.modules() if isinstance(m, kinds)), key=lambda m: m.weight.numel())
    layer = largest.to(torch.bfloat16).to_empty(device="cpu")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
            p.register_post_accumulate_grad_hook(_drop_grad)
    shape = (1, layer.in_channels, 8, 8) if isinstance(layer, torch.nn.Conv2d) else (1, 8, layer.in_features)
    loss = layer(torch.randn(*shape).to(torch.bfloat16)).float().sum()
    before = status_bytes("VmRSS")
    loss.backward()
    return {"layer": repr(layer), "weight_bytes": layer.weight.nbytes, "peak": status_bytes("VmHWM") - before}


def time_checkpointing(spec: dict[str, Any]) -> dict[str, Any]:
    """Training step times with checkpointing off and on (diffusers' own checkpoint function), alternating in one
    process so that whatever else runs on the machine slows both alike: medians of spec['steps'] rounds after a
    warm-up round."""
    torch.set_num_threads(spec["threads"])
    model: Any = build_model(spec)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(_drop_grad)
    inputs = make_inputs(spec)
    times: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(1 + spec["steps"]):
        for ckpt in (False, True):
            model.enable_gradient_checkpointing() if ckpt else model.disable_gradient_checkpointing()
            started = time.perf_counter()
            train_step(spec, model, inputs)
            if round_:
                times[ckpt].append(time.perf_counter() - started)
    return {"off": statistics.median(times[False]), "on": statistics.median(times[True]), "load": os.getloadavg()[0]}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, run one step (autograd's saved bytes counted), report its memory.

    Modes: forward (no_grad), train (every parameter trainable, each gradient dropped as it lands), lora (the adapter
    trainable, its gradients kept) and adamw (every parameter trainable, gradients kept); lora and adamw end with one
    AdamW step and report the bytes of the gradients and of the optimizer state."""
    torch.set_num_threads(spec["threads"])
    model = build_model(spec)
    layers = 0
    if spec["mode"] == "lora":
        from stk.train.trainable.lora import LoraSettings, add_lora

        layers = add_lora(model, LoraSettings(rank=LORA_RANK), PUBLISHED[config_of(spec)[0]], seed=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if spec["mode"] == "train":
        for p in trainable:
            p.register_post_accumulate_grad_hook(_drop_grad)
    saved = SavedBytes(model)
    if spec["checkpointing"]:
        model.enable_gradient_checkpointing(saved.checkpoint)  # type: ignore[operator]
    inputs = make_inputs(spec)
    gc.collect()
    reset_peak()
    model_rss = status_bytes("VmRSS")
    if spec["mode"] == "forward":
        with torch.no_grad():
            training_forward(config_of(spec)[0], model, inputs)
    else:
        with saved.recording():
            train_step(spec, model, inputs)
    result: dict[str, Any] = {
        "spec": spec,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in trainable),
        "trainable_dtype": str(trainable[0].dtype) if trainable else None,
        "lora_layers": layers,
        "largest_grad_bytes": max((p.numel() * p.element_size() for p in trainable), default=0),
        "model_rss": model_rss,
        "peak_rss": status_bytes("VmHWM"),
        "saved": dict(saved.by_kind),
        "largest_block": max(saved.by_block.values(), default=0),
        "largest_tensor": saved.largest,
    }
    if spec["mode"] in ("lora", "adamw"):
        result["grad_bytes"] = sum(p.grad.nbytes for p in trainable if p.grad is not None)
        optimizer = torch.optim.AdamW(trainable, lr=1e-5)
        optimizer.step()
        result["adamw_state_bytes"] = sum(
            t.nbytes for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
        )
    return result
