"""SD's training step against diffusers' examples/text_to_image/train_text_to_image.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from support.family_tests import EncodedText
from support.reference_steps import assert_matches_reference, tiny_objective

from stk.models import Family
from stk.models.interface import StepInputs

# the contract suite's captions as the encoders give them: CLIP's 77 positions, 32 wide (tiny.py)
ENCODED = EncodedText(
    shapes={"prompt_embeds": (77, 32)},
    long_caption_tokens=77,
)


def test_one_step_is_train_text_to_image(tmp_path) -> None:
    objective, unet = tiny_objective(Family.SD, str(tmp_path / "sd"))
    scheduler = objective.scheduler

    def reference(unet: torch.nn.Module, batch: StepInputs, noise: torch.Tensor, timesteps: torch.Tensor):
        latents = batch.latents
        noisy_latents = scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = batch.text["prompt_embeds"]
        if scheduler.config.prediction_type == "epsilon":
            target = noise
        else:
            target = scheduler.get_velocity(latents, noise, timesteps)
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
        return F.mse_loss(model_pred.float(), target.float(), reduction="mean")

    assert_matches_reference(objective, unet, reference)


def pipeline_embeddings(pipeline: Any, captions: list[str]) -> dict[str, torch.Tensor]:
    """What StableDiffusionPipeline.encode_prompt gives for `captions` (the contract suite's comparison)."""
    prompt_embeds, _ = pipeline.encode_prompt(captions, "cpu", 1, False)
    return {"prompt_embeds": prompt_embeds}
