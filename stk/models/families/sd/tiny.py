"""The tiny random-weight pipeline of this family (`build`), for tests and the demo: stk.models.tiny."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffusers import PNDMScheduler

from stk.models import tinyparts as tiny
from stk.models.families.sd import SD_BETAS

__all__ = ["build"]


def build(scratch: Path, unet: Any = None, vae: Any = None) -> dict[str, Any]:
    tokenizer = tiny.clip_tokenizer(scratch / "tokenizer")
    width = unet.config.cross_attention_dim if unet is not None else 32
    return dict(
        vae=vae or tiny.vae(4, 0.18215),
        text_encoder=tiny.clip(tokenizer, width),
        tokenizer=tokenizer,
        unet=unet or tiny.unet(width),
        scheduler=PNDMScheduler(**SD_BETAS, skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
