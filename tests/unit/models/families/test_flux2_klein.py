"""stk.models.families.flux2_klein (and flux2, what it shares with FLUX.2-dev) on the tiny FLUX.2-klein pipeline, fp32
on the CPU: the latents are the example's patchified, batch-norm-normalised ones, one step's loss and gradients are
those of diffusers' examples/dreambooth/train_dreambooth_lora_flux2_klein.py, the embeddings are
Flux2KleinPipeline.encode_prompt's, a trained LoRA loads with its load_lora_weights, and sample images from cached
embeddings are the pipeline's own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline
from support.flux2_example import assert_default_lora_targets_are_the_examples, example_step
from support.lora_files import assert_pipeline_loads_it, saved_lora
from support.reference_steps import assert_matches_reference
from support.samples import rendered_sample

from stk.models import Family, build_tiny_model
from stk.models.families import spec_for
from stk.train.batch import StepInputs, collate_text
from stk.train.objectives import objective_for
from stk.train.validation import ValidationPlan

SPEC = spec_for(Family.FLUX2_KLEIN)
CAPTIONS = ["a photo of a cat", "A red dog, on the painting with a blue man!"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(Family.FLUX2_KLEIN, str(tmp_path_factory.mktemp("flux2_klein")))


def test_the_embeddings_are_the_pipelines_encode_prompt(model: str) -> None:
    """Layers 9, 18 and 27 of Qwen3 side by side, all 512 positions; the length counts the chat's real tokens."""
    pipe = Flux2KleinPipeline.from_pretrained(model)
    embeddings = SPEC.encoders.load(model, CPU, torch.float32).encode_text(CAPTIONS)
    with torch.no_grad():
        prompt_embeds, _ = pipe.encode_prompt(list(CAPTIONS), CPU)
    ours = torch.stack([torch.from_numpy(e.arrays["prompt_embeds"]) for e in embeddings])
    assert ours.shape == prompt_embeds.shape == (2, 512, 48)
    torch.testing.assert_close(ours, prompt_embeds, rtol=1e-5, atol=1e-5)
    chats = [
        pipe.tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False)
        for c in CAPTIONS
    ]  # fmt: skip
    assert [e.length for e in embeddings] == [len(pipe.tokenizer(chat)["input_ids"]) for chat in chats]
    assert embeddings[0].length != embeddings[1].length


def test_one_step_is_train_dreambooth_lora_flux2_klein(model: str) -> None:
    """On encoded images and the pipeline's own embeddings: the latents are the example's (patchified, normalised by
    the VAE's batch-norm statistics), and so are the loss and gradients."""
    pipe = Flux2KleinPipeline.from_pretrained(model)
    encoders = SPEC.encoders.load(model, CPU, torch.float32)
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


def test_a_trained_lora_loads_into_the_pipeline(model: str, tmp_path: Path) -> None:
    trained = saved_lora(Family.FLUX2_KLEIN, model, tmp_path)
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(1, 8, 8, 6, generator=g)
    text = torch.randn(1, 5, 48, generator=g)
    assert_pipeline_loads_it(
        Family.FLUX2_KLEIN, model, tmp_path, trained,
        hidden_states=Flux2KleinPipeline._pack_latents(Flux2KleinPipeline._patchify_latents(latents)),
        encoder_hidden_states=text,
        timestep=torch.tensor([0.3]),
        img_ids=Flux2KleinPipeline._prepare_latent_ids(Flux2KleinPipeline._patchify_latents(latents)),
        txt_ids=Flux2KleinPipeline._prepare_text_ids(text),
    )  # fmt: skip


def test_samples_from_cached_embeddings_are_the_pipelines_own(model: str) -> None:
    """The renderer's path (the prompt's and the empty caption's stored embeddings, then `sample_inputs`) gives the
    image that Flux2KleinPipeline makes from the prompt's text, with the empty caption as its negative."""
    assert SPEC.sampling.negative_prompt and SPEC.sampling.guidance > 1
    prompt = CAPTIONS[1]
    plan = ValidationPlan(prompts=(prompt,), every=0, steps=2, guidance=4.0, width=64, height=48, seed=5)
    image = rendered_sample(Family.FLUX2_KLEIN, model, plan)

    pipe = Flux2KleinPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    own = pipe(prompt=prompt, num_inference_steps=2, guidance_scale=4.0, width=64, height=48,
               generator=torch.Generator().manual_seed(5)).images[0]  # fmt: skip
    assert image.shape == (48, 64, 3) and image.std() > 0
    assert np.abs(image - np.asarray(own, dtype=np.int16)).max() <= 1
