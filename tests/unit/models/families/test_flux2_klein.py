"""What is particular to FLUX.2-klein (and what it shares with FLUX.2-dev), on its tiny pipeline, fp32 on the CPU:
the latents are the example's patchified, batch-norm-normalised ones, one step's loss and gradients are those of
diffusers' examples/dreambooth/train_dreambooth_lora_flux2_klein.py, and the embeddings' lengths count the chat's
real tokens. (What every family keeps: tests/unit/models/test_contract.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from diffusers import Flux2KleinPipeline
from support.family_tests import EncodedText
from support.flux2_example import assert_default_lora_targets_are_the_examples, example_step
from support.reference_steps import assert_matches_reference

from stk.models import Family
from stk.models.families import spec_for
from stk.models.interface import StepInputs
from stk.train.data.batch import collate_text
from stk.train.objective.objectives import objective_for

SPEC = spec_for(Family.FLUX2_KLEIN)
CAPTIONS = ["a photo of a cat", "A red dog, on the painting with a blue man!"]
CPU = torch.device("cpu")


# the contract suite's captions as the encoders give them: three layers of Qwen3's 16 side by side, the padding kept;
# the empty thinking block (thinking disabled) after the chat's tokens
ENCODED = EncodedText(
    shapes={"prompt_embeds": (512, 48)},
    long_caption_tokens=134,
    kept=15,
)


@pytest.fixture(scope="module")
def model(tiny_model: Callable[[Family], str]) -> str:
    return tiny_model(Family.FLUX2_KLEIN)


def test_the_embeddings_are_the_pipelines_encode_prompt(model: str) -> None:
    """Layers 9, 18 and 27 of Qwen3 side by side, all 512 positions; the length counts the chat's real tokens."""
    pipe = Flux2KleinPipeline.from_pretrained(model)
    embeddings = SPEC.text.encoders.load(model, CPU, torch.float32).encode_text(CAPTIONS)
    with torch.no_grad():
        prompt_embeds, _ = pipe.encode_prompt(list(CAPTIONS), CPU)
    ours = torch.stack([torch.from_numpy(e.arrays["prompt_embeds"]) for e in embeddings])
    assert ours.shape == prompt_embeds.shape == (2, 512, 48)
    torch.testing.assert_close(ours, prompt_embeds, rtol=1e-5, atol=1e-5)
    chats = [
        pipe.tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        for c in CAPTIONS
    ]
    assert [e.length for e in embeddings] == [len(pipe.tokenizer(chat)["input_ids"]) for chat in chats]
    assert embeddings[0].length != embeddings[1].length


def test_one_step_is_train_dreambooth_lora_flux2_klein(model: str) -> None:
    """On encoded images and the pipeline's own embeddings: the latents are the example's (patchified, normalised by
    the VAE's batch-norm statistics), and so are the loss and gradients."""
    pipe = Flux2KleinPipeline.from_pretrained(model)
    encoders = SPEC.text.encoders.load(model, CPU, torch.float32)
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        prompt_embeds, text_ids = pipe.encode_prompt(list(CAPTIONS), CPU)
        vae = pipe.vae
        mode = vae.encode(pixels).latent_dist.mode()
    latents_bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
    latents_bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    mean, _ = encoders.encode_images(pixels)
    inputs = StepInputs(
        latents=encoders.norm.normalize(mean),
        text=collate_text([e.arrays for e in encoders.encode_text(CAPTIONS)]),
        original_size=torch.tensor([[64, 48]] * 2),
        crop_top_left=torch.zeros(2, 2, dtype=torch.long),
    )
    example_input = (Flux2KleinPipeline._patchify_latents(mode) - latents_bn_mean) / latents_bn_std
    torch.testing.assert_close(Flux2KleinPipeline._patchify_latents(inputs.latents), example_input)
    assert not torch.allclose(latents_bn_mean, torch.zeros_like(latents_bn_mean))  # the statistics matter here

    reference = example_step(Flux2KleinPipeline, prompt_embeds, text_ids)
    objective = objective_for(Family.FLUX2_KLEIN, model)
    assert_matches_reference(objective, objective.load_denoiser(torch.float32), reference, inputs)


def test_the_default_lora_targets_are_the_examples_layers(model: str) -> None:
    assert_default_lora_targets_are_the_examples(Family.FLUX2_KLEIN, model, single_blocks=24)


def pipeline_embeddings(pipeline: Any, captions: list[str]) -> dict[str, torch.Tensor]:
    """The pipeline's encode_prompt: three layers side by side, all 512 positions (the contract suite's comparison)."""
    prompt_embeds, _ = pipeline.encode_prompt(list(captions), torch.device("cpu"))
    return {"prompt_embeds": prompt_embeds}
