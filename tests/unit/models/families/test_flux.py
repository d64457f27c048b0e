"""FLUX.1's training step against diffusers' examples/dreambooth/train_dreambooth_flux.py."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxPipeline
from diffusers.training_utils import compute_loss_weighting_for_sd3
from support.family_tests import EncodedText
from support.reference_steps import assert_matches_reference, tiny_objective

from stk.models import Family
from stk.models.interface import StepInputs

# the contract suite's captions as the encoders give them: T5's 512 positions (48 wide) and CLIP's pooled vector (32);
# T5 does not stop at 77
ENCODED = EncodedText(
    shapes={"prompt_embeds": (512, 48), "pooled_prompt_embeds": (32,)},
    long_caption_tokens=102,
    tokenizers=("tokenizer_2",),
)


def test_one_step_is_train_dreambooth_flux(tmp_path) -> None:
    objective, transformer = tiny_objective(Family.FLUX, str(tmp_path / "flux"))
    vae_scale_factor = objective.vae_scale_factor
    assert transformer.config.guidance_embeds  # the tiny model is guidance-distilled, like FLUX.1-dev

    def reference(transformer: torch.nn.Module, batch: StepInputs, noise: torch.Tensor, sigmas: torch.Tensor):
        model_input = batch.latents
        bsz, channels, height, width = model_input.shape
        latent_image_ids = FluxPipeline._prepare_latent_image_ids(bsz, height // 2, width // 2, "cpu", torch.float32)
        timesteps = sigmas * 1000  # the example indexes the scheduler's timesteps; stk draws them continuously
        sigmas = sigmas.view(-1, 1, 1, 1)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        packed_noisy_model_input = FluxPipeline._pack_latents(noisy_model_input, bsz, channels, height, width)
        guidance = torch.tensor([objective.guidance_scale]).expand(bsz)
        prompt_embeds = batch.text["prompt_embeds"]
        text_ids = torch.zeros(prompt_embeds.shape[1], 3)
        model_pred = transformer(
            hidden_states=packed_noisy_model_input,
            timestep=timesteps / 1000,
            guidance=guidance,
            pooled_projections=batch.text["pooled_prompt_embeds"],
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=latent_image_ids,
            return_dict=False,
        )[0]
        model_pred = FluxPipeline._unpack_latents(
            model_pred,
            height=height * vae_scale_factor,
            width=width * vae_scale_factor,
            vae_scale_factor=vae_scale_factor,
        )
        weighting = compute_loss_weighting_for_sd3(weighting_scheme="logit_normal", sigmas=sigmas)
        target = noise - model_input
        loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(bsz, -1), 1)
        return loss.mean()

    assert_matches_reference(objective, transformer, reference)


def pipeline_embeddings(pipeline: Any, captions: list[str]) -> dict[str, torch.Tensor]:
    """What FluxPipeline.encode_prompt gives for `captions` (the contract suite's comparison)."""
    prompt_embeds, pooled, _ = pipeline.encode_prompt(captions, captions, device="cpu")
    return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}
