"""What is particular to Qwen-Image, on its tiny pipeline, fp32 on the CPU: one step's loss and gradients are those of
diffusers' examples/dreambooth/train_dreambooth_lora_qwen_image.py, and the prompt template drops the system turn as
the real tokenizer does. (What every family keeps, its encode_prompt, its video VAE's one-frame latents, LoRA and
samples included: tests/unit/models/test_contract.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from diffusers import QwenImagePipeline
from support.family_tests import EncodedText
from support.reference_steps import assert_matches_reference, example_flow_loss

from stk.models import Family
from stk.models.families import spec_for
from stk.models.families.qwenimage import DROPPED_TOKENS, MAX_SEQUENCE_LENGTH, PROMPT_TEMPLATE
from stk.models.interface import StepInputs
from stk.models.textmask import TEXT_MASK
from stk.train.data.batch import collate_text
from stk.train.objective.objectives import objective_for

SPEC = spec_for(Family.QWENIMAGE)
CAPTIONS = ["a photo of a cat", "A red dog, on the painting with a blue man!"]  # two lengths: the mask matters
CPU = torch.device("cpu")


# the contract suite's captions as the encoders give them: Qwen2.5-VL's real tokens (32 wide); the template's system
# turn and the user turn's opening 3 tokens dropped, 5 kept after the caption
ENCODED = EncodedText(
    shapes={"prompt_embeds": (1024, 32), TEXT_MASK: (1024, 1)},
    long_caption_tokens=106,
    kept=-3,
)


@pytest.fixture(scope="module")
def model(tiny_model: Callable[[Family], str]) -> str:
    return tiny_model(Family.QWENIMAGE)


def test_one_step_is_train_dreambooth_lora_qwen_image(model: str) -> None:
    """On encoded images and captions of two lengths: the latents are the example's (one frame, normalised per
    channel), and so are the loss and gradients, its transformer given the pipeline's encode_prompt and mask."""
    pipe = QwenImagePipeline.from_pretrained(model)
    encoders = SPEC.text.encoders.load(model, CPU, torch.float32)
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        prompt_embeds, prompt_embeds_mask = pipe.encode_prompt(CAPTIONS, CPU)
        mode = pipe.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()  # the example's (B, C, 1, H, W) pixels
    latents_mean = torch.tensor(pipe.vae.config.latents_mean).view(1, pipe.vae.config.z_dim, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, pipe.vae.config.z_dim, 1, 1, 1)
    vae_scale_factor = 2 ** len(pipe.vae.temperal_downsample)
    mean, _ = encoders.encode_images(pixels)
    inputs = StepInputs(
        latents=encoders.norm.normalize(mean),
        text=collate_text([e.arrays for e in encoders.encode_text(CAPTIONS)]),
        original_size=torch.tensor([[64, 48]] * 2),
        crop_top_left=torch.zeros(2, 2, dtype=torch.long),
    )
    torch.testing.assert_close(inputs.latents[:, :, None], (mode - latents_mean) * latents_std)
    assert prompt_embeds_mask is not None and not prompt_embeds_mask.all()

    def reference(transformer: torch.nn.Module, batch: StepInputs, noise: torch.Tensor, sigmas: torch.Tensor):
        model_input = batch.latents[:, :, None]  # the example's latents keep the VAE's frame axis
        noise = noise[:, :, None]  # torch.randn_like(model_input): the same values in the same order
        bsz = model_input.shape[0]
        timesteps = sigmas * 1000  # the example indexes the scheduler's timesteps; stk draws them continuously
        sigmas = sigmas.view(-1, 1, 1, 1, 1)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        latent_height, latent_width = model_input.shape[3], model_input.shape[4]
        img_shapes = [(1, latent_height // 2, latent_width // 2)] * bsz
        noisy_model_input = noisy_model_input.permute(0, 2, 1, 3, 4)
        packed_noisy_model_input = QwenImagePipeline._pack_latents(
            noisy_model_input,
            batch_size=model_input.shape[0],
            num_channels_latents=model_input.shape[1],
            height=model_input.shape[3],
            width=model_input.shape[4],
        )
        model_pred = transformer(
            hidden_states=packed_noisy_model_input,
            encoder_hidden_states=prompt_embeds,
            encoder_hidden_states_mask=prompt_embeds_mask,
            timestep=timesteps / 1000,
            img_shapes=img_shapes,
            return_dict=False,
        )[0]
        model_pred = QwenImagePipeline._unpack_latents(
            model_pred, latent_height * vae_scale_factor, latent_width * vae_scale_factor, vae_scale_factor
        )
        return example_flow_loss(model_pred, noise, model_input, sigmas)

    objective = objective_for(Family.QWENIMAGE, model)
    assert_matches_reference(objective, objective.load_denoiser(torch.float32), reference, inputs)


def test_the_template_is_the_pipelines_and_drops_its_system_turn(model: str) -> None:
    """The template's first DROPPED_TOKENS tokens are its system turn and the user turn's opening, in the tiny
    vocabulary as in Qwen's: what is kept is the caption and the turn's end."""
    pipe = QwenImagePipeline.from_pretrained(model)
    assert pipe.prompt_template_encode == PROMPT_TEMPLATE
    assert (pipe.prompt_template_encode_start_idx, pipe.tokenizer_max_length) == (DROPPED_TOKENS, MAX_SEQUENCE_LENGTH)
    tokenizer = pipe.tokenizer
    system, _, after = PROMPT_TEMPLATE.partition("{}")
    assert len(tokenizer(system)["input_ids"]) == DROPPED_TOKENS
    ids = tokenizer(PROMPT_TEMPLATE.format("a cat"))["input_ids"]
    assert tokenizer.decode(ids[DROPPED_TOKENS:]) == "a cat" + after
    (embedding,) = SPEC.text.encoders.load(model, CPU, torch.float32).encode_text(["a cat"])
    assert embedding.length == len(ids) - DROPPED_TOKENS


def pipeline_embeddings(pipeline: Any, captions: list[str]) -> dict[str, torch.Tensor]:
    """QwenImagePipeline.encode_prompt: zero-padded to the longest caption, with its mask (the contract suite's
    comparison)."""
    prompt_embeds, mask = pipeline.encode_prompt(captions, "cpu")
    return {"prompt_embeds": prompt_embeds, TEXT_MASK: mask[..., None].float()}
