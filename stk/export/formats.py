"""Which output format can hold which trained thing: the one table the command's choices, its refusals and its help
read. A new adapter type is a line here and its tensors' mark in `adapters.KINDS`."""

from __future__ import annotations

import enum

from stk.errors import InputError

__all__ = ["FORMATS", "Format", "check_format"]


class Format(str, enum.Enum):
    DIFFUSERS = "diffusers"  # the diffusers/peft LoRA file that `pipe.load_lora_weights` reads (stk-train's own)
    KOHYA = "kohya"  # kohya/ComfyUI's LoRA keys (`lora_unet_...`; `diffusion_model....` for the DiT families)
    SINGLE_FILE = "single-file"  # the whole fine-tuned model in its original layout, one .safetensors


# what was trained ("full" or an adapter type, as `adapters.adapter_kind` names it) -> the formats that hold it
FORMATS: dict[str, tuple[Format, ...]] = {
    "lora": (Format.DIFFUSERS, Format.KOHYA),
    "dora": (Format.DIFFUSERS,),  # kohya's keys have no magnitude vector
    # LoHa, LoKr: final/ holds peft's folder already (adapter_config.json beside the weights), which no one file holds
    "loha": (),
    "lokr": (),
    "full": (Format.SINGLE_FILE,),
}


def check_format(trained: str, chosen: Format, source: str) -> None:
    """InputError (exit 3) naming the formats that can hold `trained` when `chosen` cannot."""
    fits = FORMATS.get(trained, ())
    if chosen not in fits:
        what = "a full fine-tune" if trained == "full" else f"a {trained} adapter"
        names = ", ".join(f.value for f in fits) or "none (stk-train's final/ holds it in peft's format already)"
        raise InputError(f"{source}: --format {chosen.value} cannot hold {what}; formats that can: {names}")
