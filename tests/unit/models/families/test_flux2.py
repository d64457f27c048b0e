"""stk.models.families.flux2 as the FLUX.2-dev family, on the tiny FLUX.2-dev pipeline (Mistral3 text encoder), fp32
on the CPU: the embeddings are Flux2Pipeline.encode_prompt's, one step's loss and gradients are those of diffusers'
examples/dreambooth/train_dreambooth_lora_flux2.py (guidance input included), a trained LoRA loads with the
pipeline's load_lora_weights, and sample images from cached embeddings are the pipeline's own. What FLUX.2-dev
shares with FLUX.2-klein (the latents' normalisation) is checked in test_flux2_klein.py."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline
from diffusers.training_utils import compute_loss_weighting_for_sd3
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from PIL import Image
from support.lora_files import assert_pipeline_loads_it, saved_lora
from support.reference_steps import assert_matches_reference

from stk.models import Family, build_tiny_model
from stk.models.families import spec_for
from stk.train.batch import StepInputs, collate_text
from stk.train.embeddings import embed_captions
from stk.train.lora import LoraSettings, add_lora
from stk.train.objectives import objective_for
from stk.train.render import ValidationRenderer
from stk.train.validation import ValidationPlan

SPEC = spec_for(Family.FLUX2)
CAPTIONS = ["a photo of a cat", "A red dog, on the painting with a blue man!"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(Family.FLUX2, str(tmp_path_factory.mktemp("flux2")))


def test_the_embeddings_are_the_pipelines_encode_prompt(model: str) -> None:
    """Layers 10, 20 and 30 of Mistral3 side by side, all 512 positions; the length counts the chat's real tokens,
    the pipeline's system message included."""
    pipe = Flux2Pipeline.from_pretrained(model)
    embeddings = SPEC.encoders.load(model, CPU, torch.float32).encode_text(CAPTIONS)
    with torch.no_grad():
        prompt_embeds, _ = pipe.encode_prompt(list(CAPTIONS), CPU)
    ours = torch.stack([torch.from_numpy(e.arrays["prompt_embeds"]) for e in embeddings])
    assert ours.shape == prompt_embeds.shape == (2, 512, 48)
    torch.testing.assert_close(ours, prompt_embeds, rtol=1e-5, atol=1e-5)
    chats = [
        [{"role": "system", "content": pipe.system_message}, {"role": "user", "content": caption}]
        for caption in CAPTIONS
    ]
    chat_tokens = [pipe.tokenizer.apply_chat_template(c, return_dict=True)["input_ids"] for c in chats]
    assert [e.length for e in embeddings] == [len(ids) for ids in chat_tokens]
    assert embeddings[0].length != embeddings[1].length


def test_one_step_is_train_dreambooth_lora_flux2(model: str) -> None:
    """On the pipeline's own embeddings: the loss and gradients of the example's step, the guidance-distilled
    transformer given the example's default --guidance_scale (stk's default too)."""
    pipe = Flux2Pipeline.from_pretrained(model)
    encoders = SPEC.encoders.load(model, CPU, torch.float32)
    with torch.no_grad():
        prompt_embeds, text_ids = pipe.encode_prompt(list(CAPTIONS), CPU)
    inputs = StepInputs(
        latents=torch.randn(2, 8, 8, 6, generator=torch.Generator().manual_seed(1)),
        text=collate_text([e.arrays for e in encoders.encode_text(CAPTIONS)]),
        original_size=torch.tensor([[64, 48]] * 2),
        crop_top_left=torch.zeros(2, 2, dtype=torch.long),
    )
    args_guidance_scale = 3.5  # the example's --guidance_scale default
    assert pipe.transformer.config.guidance_embeds

    def reference(transformer: torch.nn.Module, batch: StepInputs, noise: torch.Tensor, sigmas: torch.Tensor):
        # stk's latents and noise are in the VAE's layout: patchified here, as the example patchifies its latents
        model_input = Flux2Pipeline._patchify_latents(batch.latents)
        noise = Flux2Pipeline._patchify_latents(noise)
        model_input_ids = Flux2Pipeline._prepare_latent_ids(model_input).to(device=model_input.device)
        timesteps = sigmas * 1000  # the example indexes the scheduler's timesteps; stk draws them continuously
        sigmas = sigmas.view(-1, 1, 1, 1)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        packed_noisy_model_input = Flux2Pipeline._pack_latents(noisy_model_input)
        guidance = torch.full([1], args_guidance_scale)
        guidance = guidance.expand(model_input.shape[0])
        model_pred = transformer(
            hidden_states=packed_noisy_model_input,
            timestep=timesteps / 1000,
            guidance=guidance,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=model_input_ids,
            return_dict=False,
        )[0]
        model_pred = model_pred[:, : packed_noisy_model_input.size(1) :]
        model_pred = Flux2Pipeline._unpack_latents_with_ids(model_pred, model_input_ids)
        weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
        target = noise - model_input
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1),
            1,
        )
        return loss.mean()

    objective = objective_for(Family.FLUX2, model)
    assert objective.guidance_scale == args_guidance_scale
    assert_matches_reference(objective, objective.load_denoiser(torch.float32), reference, inputs)


def test_the_guidance_reaches_the_transformer(model: str) -> None:
    """Another --guidance-scale, another loss: the guidance embedding is trained as the example trains it."""
    inputs = StepInputs(
        latents=torch.randn(1, 8, 8, 8, generator=torch.Generator().manual_seed(1)),
        text={"prompt_embeds": torch.randn(1, 5, 48, generator=torch.Generator().manual_seed(2))},
        original_size=torch.tensor([[64, 64]]),
        crop_top_left=torch.zeros(1, 2, dtype=torch.long),
    )
    losses = []
    for scale in (3.5, 1.0):
        objective = objective_for(Family.FLUX2, model, guidance_scale=scale)
        with torch.no_grad():
            denoiser = objective.load_denoiser(torch.float32)
            losses.append(objective.loss(denoiser, inputs, torch.Generator().manual_seed(0)))
    assert not torch.allclose(losses[0], losses[1])


def test_the_default_lora_targets_are_the_examples_layers(model: str) -> None:
    """The example's target_modules list the single blocks' `attn.to_out` by index (up to 48); stk's `attn.to_out`
    adapts the same layers at any depth (not the double blocks' list of that name)."""
    objective = objective_for(Family.FLUX2, model)
    ours = objective.load_denoiser(torch.float32)
    add_lora(ours, LoraSettings(rank=4), Family.FLUX2, seed=0)
    target_modules = ["to_k", "to_q", "to_v", "to_out.0"] + [  # noqa: RUF005 (the example's lines)
        "to_qkv_mlp_proj",
        *[f"single_transformer_blocks.{i}.attn.to_out" for i in range(48)],
    ]
    theirs = objective.load_denoiser(torch.float32)
    theirs.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=target_modules))
    adapted = [{n for n, m in d.named_modules() if isinstance(m, LoraLayer)} for d in (ours, theirs)]
    assert adapted[0] == adapted[1]
    assert any(n.startswith("single_transformer_blocks.") and n.endswith("attn.to_out") for n in adapted[0])


def test_a_trained_lora_loads_into_the_pipeline(model: str, tmp_path: Path) -> None:
    trained = saved_lora(Family.FLUX2, model, tmp_path)
    g = torch.Generator().manual_seed(2)
    latents = Flux2Pipeline._patchify_latents(torch.randn(1, 8, 8, 6, generator=g))
    text = torch.randn(1, 5, 48, generator=g)
    assert_pipeline_loads_it(
        Family.FLUX2, model, tmp_path, trained,
        hidden_states=Flux2Pipeline._pack_latents(latents),
        encoder_hidden_states=text,
        timestep=torch.tensor([0.3]),
        guidance=torch.tensor([3.5]),
        img_ids=Flux2Pipeline._prepare_latent_ids(latents),
        txt_ids=Flux2Pipeline._prepare_text_ids(text),
    )  # fmt: skip


def test_samples_from_cached_embeddings_are_the_pipelines_own(model: str) -> None:
    """The renderer's path (the prompt's stored embeddings, then `sample_inputs`; no negative prompt: the guidance is
    the transformer's input) gives the image that Flux2Pipeline makes from the prompt's text."""
    assert not SPEC.sampling.negative_prompt and SPEC.sampling.guidance > 1
    prompt = CAPTIONS[1]
    encoders = SPEC.encoders.load(model, CPU, torch.float32)
    embeddings = embed_captions([prompt], lambda caption: None, lambda: encoders)
    objective = objective_for(Family.FLUX2, model)
    plan = ValidationPlan(prompts=(prompt,), every=0, steps=2, guidance=4.0, width=64, height=48, seed=5)
    renderer = ValidationRenderer(plan, objective, objective.load_denoiser(torch.float32), embeddings, CPU,
                                  torch.float32, 0, 1)  # fmt: skip
    (sample,) = renderer.render(contextlib.nullcontext()).pngs.values()
    image = np.asarray(Image.open(io.BytesIO(sample)), dtype=np.int16)

    pipe = Flux2Pipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    own = pipe(prompt=prompt, num_inference_steps=2, guidance_scale=4.0, width=64, height=48,
               generator=torch.Generator().manual_seed(5)).images[0]  # fmt: skip
    assert image.shape == (48, 64, 3) and image.std() > 0
    assert np.abs(image - np.asarray(own, dtype=np.int16)).max() <= 1
