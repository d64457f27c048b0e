"""The DeepSpeed config a run uses: a preset from etc/deepspeed/ (or the user's own file) with the
settings stk-train owns filled in from its options.

Presets hold only what differs between ZeRO setups. Batch size, gradient accumulation, clipping and
precision come from stk-train's options so that one flag changes them everywhere (the sampler, the
batch check, the LR schedule and DeepSpeed agree); a user file that sets them differently is
overridden, with a warning naming each key.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from typing import Any

from stk.errors import InputError
from stk.log import get_logger

__all__ = ["PRESETS", "builds_own_optimizer", "load_deepspeed_config", "training_config", "zero_stage"]

log = get_logger("train.dsconfig")

PRESETS = ("zero1", "zero2", "zero3", "zero2-offload")
PRECISIONS = ("bf16", "fp32")


def load_deepspeed_config(name_or_path: str) -> dict[str, Any]:
    """A preset by name (zero1, zero2, zero3, zero2-offload) or a DeepSpeed JSON file."""
    if name_or_path in PRESETS:
        text = (
            resources.files("stk.train.deepspeed")
            .joinpath("presets", f"{name_or_path}.json")
            .read_text(encoding="utf-8")
        )
        source = f"preset {name_or_path}"
    else:
        try:
            with open(name_or_path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise InputError(
                f"--deepspeed {name_or_path}: {exc.strerror}; give a JSON file or a preset: {', '.join(PRESETS)}"
            ) from exc
        source = name_or_path
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{source}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise InputError(f"{source}: a DeepSpeed config is a JSON object, not {type(config).__name__}")
    if config.get("fp16", {}).get("enabled"):
        raise InputError(
            f"{source}: fp16 is not supported by stk-train (SDXL and Flux activations overflow it); use bf16"
        )
    return config


def zero_stage(config: dict[str, Any]) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def builds_own_optimizer(config: dict[str, Any]) -> bool:
    """DeepSpeed must build the optimizer itself when it offloads it (its CPU Adam/Lion), or when the
    config names one; otherwise stk passes a torch optimizer."""
    offload = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return "optimizer" in config or offload not in (None, "none")


def training_config(
    base: dict[str, Any],
    micro_batch: int,
    grad_accum: int,
    max_grad_norm: float,
    precision: str,
    optimizer_section: dict[str, Any] | None,
) -> dict[str, Any]:
    """`base` with stk-train's settings: the config deepspeed.initialize gets."""
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    config = copy.deepcopy(base)
    owned = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": max_grad_norm,
    }
    for key, value in owned.items():
        if key in config and config[key] != value:
            log.warning("DeepSpeed config sets %s=%s; stk-train's option gives %s, which wins", key, config[key], value)
    config.pop("train_batch_size", None)  # derived by DeepSpeed from the two above and the world size
    config.update(owned)
    config["bf16"] = {**config.get("bf16", {}), "enabled": precision == "bf16"}
    config.pop("fp16", None)
    if optimizer_section is not None:
        config["optimizer"] = optimizer_section
    config.pop("scheduler", None)  # the LR schedule is stk-train's (--lr-schedule), stepped by the engine
    return config
