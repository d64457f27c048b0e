"""What is particular to Chroma, on its tiny pipeline, fp32 on the CPU: one step's loss and gradients are those of
diffusers' FLUX.1 training example with the transformer called as ChromaPipeline calls it, the text keeps the one
padding token the pipeline's mask keeps, its LoRA targets are FLUX.1's, and sample images come from cached
embeddings. (What every family keeps: tests/unit/models/test_contract.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import ChromaPipeline
from support.family_tests import EncodedText
from support.reference_steps import Reference, assert_matches_reference, example_flow_loss
from torch.nn.utils.rnn import pad_sequence

from stk.models import Family
from stk.models.families import spec_for
from stk.models.families.flux import LORA_TARGETS as FLUX_TARGETS
from stk.models.interface import StepInputs
from stk.models.textmask import TEXT_MASK
from stk.train.data.batch import collate_text
from stk.train.objective.objectives import objective_for
from stk.train.trainable.lora import LoraSettings, add_lora

SPEC = spec_for(Family.CHROMA)
# of different lengths, so a batch of them is zero-padded and its mask masks something; "" is the negative prompt
CAPTIONS = ["a photo of a cat", "the red dog on the painting with a man and a blue cat", ""]


# the contract suite's captions as the encoders give them: T5's real tokens and the one padding token the pipeline's
# mask keeps after them
ENCODED = EncodedText(
    shapes={"prompt_embeds": (512, 48), TEXT_MASK: (512, 1)},
    long_caption_tokens=103,
    kept=1,
)


@pytest.fixture(scope="module")
def model(tiny_model: Callable[[Family], str]) -> str:
    return tiny_model(Family.CHROMA)


@pytest.fixture(scope="module")
def pipeline(model: str) -> ChromaPipeline:
    return ChromaPipeline.from_pretrained(model)


@pytest.fixture(scope="module")
def cached(model: str) -> list[dict[str, np.ndarray]]:
    """Each caption's arrays as the cache stores them."""
    encoders = SPEC.text.encoders.load(model, torch.device("cpu"), torch.float32)
    return [embedding.arrays for embedding in encoders.encode_text(CAPTIONS)]


def batch(cached: list[dict[str, np.ndarray]]) -> StepInputs:
    """The first two captions as the cache's collate batches them (zero-padded to the longer), with random latents."""
    latents = torch.randn(2, 16, 8, 6, generator=torch.Generator().manual_seed(3))
    return StepInputs(latents, collate_text(cached[:2]), torch.zeros(2, 2), torch.zeros(2, 2))


# --- the loss -----------------------------------------------------------------------------------------------------


def reference_step(pipeline: ChromaPipeline, vae_scale_factor: int) -> Reference:
    """diffusers' examples/dreambooth/train_dreambooth_lora_flux.py's loss lines (weighting_scheme "none", no prior
    preservation), the transformer called as ChromaPipeline.__call__ calls it: no guidance, no pooled projections,
    the attention mask of its _prepare_attention_mask; diffusers' plain forward, not checkpointed."""

    def reference(transformer: Any, batch: StepInputs, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        transformer.disable_gradient_checkpointing()
        model_input = batch.latents
        bsz, channels, height, width = model_input.shape
        latent_image_ids = ChromaPipeline._prepare_latent_image_ids(bsz, height // 2, width // 2, "cpu", torch.float32)
        timesteps = sigmas * 1000  # the example indexes the scheduler's timesteps; stk draws them continuously
        sigmas = sigmas.view(-1, 1, 1, 1)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        packed_noisy_model_input = ChromaPipeline._pack_latents(noisy_model_input, bsz, channels, height, width)
        prompt_embeds = batch.text["prompt_embeds"]
        text_ids = torch.zeros(prompt_embeds.shape[1], 3)
        attention_mask = pipeline._prepare_attention_mask(
            batch_size=bsz,
            sequence_length=packed_noisy_model_input.shape[1],
            dtype=model_input.dtype,
            attention_mask=batch.text[TEXT_MASK][..., 0] > 0.5,  # what the cache stored, as the pipeline takes it
        )
        model_pred = transformer(
            hidden_states=packed_noisy_model_input,
            timestep=timesteps / 1000,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=latent_image_ids,
            attention_mask=attention_mask,
            return_dict=False,
        )[0]
        model_pred = ChromaPipeline._unpack_latents(
            model_pred,
            height=height * vae_scale_factor,
            width=width * vae_scale_factor,
            vae_scale_factor=vae_scale_factor,
        )
        return example_flow_loss(model_pred, noise, model_input, sigmas)

    return reference


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_one_step_is_the_flux_examples_with_chromas_call(
    model: str, pipeline: ChromaPipeline, cached: list[dict[str, np.ndarray]], checkpointing: bool
) -> None:
    """On a batch of two cached captions of different lengths, so the mask masks the shorter one's padding; stk
    trains checkpointed by default."""
    objective = objective_for(Family.CHROMA, model)
    denoiser = objective.load_denoiser(torch.float32)
    if checkpointing:
        denoiser.enable_gradient_checkpointing()
    inputs = batch(cached)
    assert not (inputs.text[TEXT_MASK] > 0.5).all(), "the batch must pad one caption"
    assert_matches_reference(objective, denoiser, reference_step(pipeline, objective.vae_scale_factor), inputs)


def test_checkpointed_diffusers_forward_drops_the_mask_that_stk_hands_on(
    model: str, cached: list[dict[str, np.ndarray]]
) -> None:
    """Why chroma._MaskedCheckpoint exists: ChromaTransformer2DModel's checkpointed single-stream blocks get no mask.
    When this fails, diffusers passes it itself and _MaskedCheckpoint can go."""
    denoiser = objective_for(Family.CHROMA, model).load_denoiser(torch.float32)
    inputs = batch(cached)
    hidden = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1))
    mask = torch.cat([inputs.text[TEXT_MASK][..., 0] > 0.5, torch.ones(2, 12, dtype=torch.bool)], dim=1)
    length = inputs.text["prompt_embeds"].shape[1]
    call = dict(
        hidden_states=hidden,
        encoder_hidden_states=inputs.text["prompt_embeds"],
        timestep=torch.rand(2),
        txt_ids=torch.zeros(length, 3),
        img_ids=torch.zeros(12, 3),
        attention_mask=mask,
        return_dict=False,
    )
    plain = denoiser(**call)[0]
    denoiser.enable_gradient_checkpointing()
    assert not torch.allclose(denoiser(**call)[0], plain, atol=1e-5)


# --- text -----------------------------------------------------------------------------------------------------------


def test_encode_text_is_the_pipelines_encode_prompt(
    pipeline: ChromaPipeline, cached: list[dict[str, np.ndarray]]
) -> None:
    """The real tokens and the one padding token the pipeline's mask keeps: its embeddings there, its mask's length."""
    with torch.no_grad():
        embeds, _, mask, *_ = pipeline.encode_prompt(CAPTIONS, device="cpu", do_classifier_free_guidance=False)
    for i, arrays in enumerate(cached):
        kept = int(mask[i].sum())
        assert mask[i, :kept].all() and not mask[i, kept:].any()
        assert arrays["prompt_embeds"].shape == (kept, 48) and arrays[TEXT_MASK].shape == (kept, 1)
        assert (arrays[TEXT_MASK] == 1).all()
        torch.testing.assert_close(torch.from_numpy(arrays["prompt_embeds"]), embeds[i, :kept])
    assert len(cached[2]["prompt_embeds"]) == 2  # "": its end token and one padding token


# --- LoRA -----------------------------------------------------------------------------------------------------------


def test_lora_targets_are_fluxs_and_name_layers_of_chromas_blocks(model: str) -> None:
    assert SPEC.denoiser.lora_targets == FLUX_TARGETS
    denoiser = objective_for(Family.CHROMA, model).load_denoiser(torch.float32)
    names = [name for name, _ in denoiser.named_modules()]
    for target in SPEC.denoiser.lora_targets:
        assert any(name.startswith("transformer_blocks.") and name.endswith(target) for name in names), target
    add_lora(denoiser, LoraSettings(rank=4), Family.CHROMA, seed=0)
    adapted = {name for name, p in denoiser.named_parameters() if p.requires_grad}
    assert not any(name.startswith(("distilled_guidance_layer", "proj_out")) for name in adapted)


# --- sample images --------------------------------------------------------------------------------------------------


def test_samples_from_cached_embeddings_with_the_empty_caption_as_negative(
    pipeline: ChromaPipeline, cached: list[dict[str, np.ndarray]]
) -> None:
    """What stk.train.validation.render hands the pipeline: the prompt's and the negative's arrays, zero-padded to one
    length; the boolean mask makes that padding invisible, so the image is the unpadded one."""
    assert SPEC.sampling.negative_prompt and SPEC.sampling.guidance > 1
    prompt, negative = (collate_text([cached[i]]) for i in (0, 2))
    padded = collate_text([cached[0], cached[2]])
    images = []
    for cond, neg in (
        (prompt, negative),
        ({k: v[:1] for k, v in padded.items()}, {k: v[1:] for k, v in padded.items()}),
    ):
        embeddings = {**cond, **{f"negative_{name}": value for name, value in neg.items()}}
        arguments = SPEC.sampling.inputs(embeddings)
        assert arguments["prompt_attention_mask"].dtype == torch.bool
        assert set(arguments) == {
            "prompt_embeds",
            "prompt_attention_mask",
            "negative_prompt_embeds",
            "negative_prompt_attention_mask",
        }
        images.append(
            pipeline(
                **arguments,
                num_inference_steps=2,
                guidance_scale=SPEC.sampling.guidance,
                height=64,
                width=64,
                output_type="latent",
                generator=torch.Generator().manual_seed(0),
            ).images
        )
    assert images[0].shape == (1, 16, 64) and torch.isfinite(images[0]).all()
    torch.testing.assert_close(images[1], images[0], rtol=1e-5, atol=1e-6)


def pipeline_embeddings(pipeline: Any, captions: list[str]) -> dict[str, torch.Tensor]:
    """ChromaPipeline.encode_prompt's embeddings where its mask keeps them (the real tokens and one padding token),
    zero-padded to the longest, with that mask (the contract suite's comparison)."""
    embeds, _, mask, *_ = pipeline.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
    kept = [embeds[i, : int(m.sum())] for i, m in enumerate(mask)]
    return {
        "prompt_embeds": pad_sequence(kept, batch_first=True),
        TEXT_MASK: pad_sequence([torch.ones(len(k), 1) for k in kept], batch_first=True),
    }


def pipeline_sample_arguments(pipeline: Any, prompt: str) -> dict[str, torch.Tensor]:
    """ChromaPipeline's own encode_prompt with its masks as booleans, the contract suite's reference for samples:
    called with text, the pipeline hands the transformer a float mask, which it adds to the attention scores, so the
    padding is attended to; stk samples, and trains, with the padding masked out."""
    embeds, _, mask, negative, _, negative_mask = pipeline.encode_prompt(
        prompt, negative_prompt="", device="cpu", do_classifier_free_guidance=True
    )[:6]
    return {
        "prompt_embeds": embeds,
        "prompt_attention_mask": mask.bool(),
        "negative_prompt_embeds": negative,
        "negative_prompt_attention_mask": negative_mask.bool(),
    }
