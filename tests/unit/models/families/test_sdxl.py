"""SDXL's training step against diffusers' examples/text_to_image/train_text_to_image_sdxl.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from support.family_tests import EncodedText
from support.reference_steps import assert_matches_reference, tiny_objective

from stk.models import Family
from stk.models.interface import StepInputs

# the contract suite's captions as the encoders give them: both CLIPs' penultimate states side by side (32 + 64), the
# second's pooled vector
ENCODED = EncodedText(
    shapes={"prompt_embeds": (77, 96), "pooled_prompt_embeds": (64,)},
    long_caption_tokens=77,
    tokenizers=("tokenizer", "tokenizer_2"),
)


def test_one_step_is_train_text_to_image_sdxl(tmp_path) -> None:
    objective, unet = tiny_objective(Family.SDXL, str(tmp_path / "sdxl"))
    scheduler = objective.scheduler

    def reference(unet: torch.nn.Module, batch: StepInputs, noise: torch.Tensor, timesteps: torch.Tensor):
        model_input = batch.latents
        resolution = model_input.shape[-1] * objective.vae_scale_factor  # the example's square --resolution
        noisy_model_input = scheduler.add_noise(model_input, noise, timesteps)

        def compute_time_ids(original_size, crops_coords_top_left):
            target_size = (resolution, resolution)
            add_time_ids = list(original_size + crops_coords_top_left + target_size)
            return torch.tensor([add_time_ids], dtype=model_input.dtype)

        sizes = [tuple(s.tolist()) for s in batch.original_size]
        crops = [tuple(c.tolist()) for c in batch.crop_top_left]
        add_time_ids = torch.cat([compute_time_ids(s, c) for s, c in zip(sizes, crops, strict=True)])
        unet_added_conditions = {"time_ids": add_time_ids, "text_embeds": batch.text["pooled_prompt_embeds"]}
        model_pred = unet(
            noisy_model_input,
            timesteps,
            batch.text["prompt_embeds"],
            added_cond_kwargs=unet_added_conditions,
            return_dict=False,
        )[0]
        target = (
            noise
            if scheduler.config.prediction_type == "epsilon"
            else scheduler.get_velocity(model_input, noise, timesteps)
        )
        return F.mse_loss(model_pred.float(), target.float(), reduction="mean")

    assert_matches_reference(objective, unet, reference)


def pipeline_embeddings(pipeline: Any, captions: list[str]) -> dict[str, torch.Tensor]:
    """What StableDiffusionXLPipeline.encode_prompt gives for `captions` (the contract suite's comparison)."""
    prompt_embeds, _, pooled, _ = pipeline.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
    return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}
