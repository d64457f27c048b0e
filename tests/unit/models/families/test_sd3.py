"""SD3.5 (stk.models.families.sd3) against diffusers on the tiny model, fp32 on the CPU: one step's loss and gradients
equal a transcription of train_dreambooth_lora_sd3.py's, the text embeddings equal StableDiffusion3Pipeline's
encode_prompt, a trained LoRA loads with load_lora_weights, and the pipeline samples from cached-style embeddings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.training_utils import compute_loss_weighting_for_sd3
from support.family_tests import EncodedText
from support.lora_files import assert_pipeline_loads_it, saved_lora
from support.reference_steps import assert_matches_reference
from support.tiny_batches import step_inputs
from transformers import AutoTokenizer

from stk.models import Family
from stk.models.families import spec_for
from stk.models.interface import StepInputs
from stk.train.objective.losses import flow_shift
from stk.train.objective.objectives import FlowObjective, objective_for

SPEC = spec_for(Family.SD3)
CAPTIONS = ["a photo of a cat", "", "the " * 100 + "cat"]  # the empty caption (the negative); the last overflows CLIP


# the contract suite's captions as the encoders give them: CLIPs' 77 positions, then T5's 256 (160 = T5's width); the
# 77 CLIP positions are kept before T5's tokens
ENCODED = EncodedText(
    shapes={"prompt_embeds": (77 + 256, 160), "pooled_prompt_embeds": (128,)},
    long_caption_tokens=77 + 102,
    tokenizers=("tokenizer_3",),
    kept=77,
)


@pytest.fixture(scope="module")
def model(tiny_model: Callable[[Family], str]) -> str:
    return tiny_model(Family.SD3)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_one_step_is_train_dreambooth_lora_sd3(model: str) -> None:
    """Its defaults: --weighting_scheme logit_normal, --precondition_outputs 1."""
    objective = objective_for(Family.SD3, model)
    transformer = objective.load_denoiser(torch.float32)

    def reference(transformer: torch.nn.Module, batch: StepInputs, noise: torch.Tensor, sigmas: torch.Tensor):
        model_input = batch.latents  # (vae sample - shift_factor) * scaling_factor: stk-train's step normalises
        timesteps = sigmas * 1000  # the example indexes the scheduler's timesteps; stk draws them continuously
        sigmas = sigmas.view(-1, 1, 1, 1)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        model_pred = transformer(
            hidden_states=noisy_model_input,
            timestep=timesteps,
            encoder_hidden_states=batch.text["prompt_embeds"],
            pooled_projections=batch.text["pooled_prompt_embeds"],
            return_dict=False,
        )[0]
        model_pred = model_pred * (-sigmas) + noisy_model_input
        weighting = compute_loss_weighting_for_sd3(weighting_scheme="logit_normal", sigmas=sigmas)
        target = model_input
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1
        )
        return loss.mean()

    assert_matches_reference(objective, transformer, reference)


def test_sigmas_are_shifted_as_the_examples_scheduler_shifts(model: str) -> None:
    """The example indexes the scheduler's discrete sigmas (static shift 3, no dynamic shifting) at floor(1000 u),
    u logit-normal; so does stk."""
    objective = objective_for(Family.SD3, model)
    assert isinstance(objective, FlowObjective)
    config = objective.scheduler.config
    assert config["shift"] == 3.0 and not config["use_dynamic_shifting"] and config["num_train_timesteps"] == 1000
    grid = torch.linspace(1.0, 1 / 1000, 1000)
    torch.testing.assert_close(objective.scheduler.sigmas, flow_shift(grid, 3.0))
    torch.testing.assert_close(objective.scheduler.timesteps, objective.scheduler.sigmas * 1000)
    u = torch.sigmoid(torch.normal(0.0, 1.0, size=(64,), generator=seeded(5)))
    torch.testing.assert_close(objective.sigmas(64, 16, seeded(5)), objective.scheduler.sigmas[(u * 1000).long()])


def test_text_is_the_pipelines_encode_prompt_and_trimming_drops_t5_padding_only(model: str) -> None:
    encoders = SPEC.text.encoders.load(model, torch.device("cpu"), torch.float32)
    embeddings = encoders.encode_text(CAPTIONS)
    pipeline = StableDiffusion3Pipeline.from_pretrained(model)
    with torch.no_grad():
        prompt_embeds, _, pooled, _ = pipeline.encode_prompt(
            CAPTIONS, CAPTIONS, CAPTIONS, device="cpu", do_classifier_free_guidance=False
        )
    ours = {k: torch.from_numpy(np.stack([e.arrays[k] for e in embeddings])) for k in SPEC.text.encoders.text_outputs}
    assert prompt_embeds.shape == (3, 77 + 256, 160) and pooled.shape == (3, 128)
    torch.testing.assert_close(ours["prompt_embeds"], prompt_embeds, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["pooled_prompt_embeds"], pooled, rtol=1e-5, atol=1e-5)

    # the stored length keeps all 77 CLIP positions and T5's real tokens (its end token included): what
    # --trim-padding drops is T5's padding, the tokens after them
    tokenizer_3 = AutoTokenizer.from_pretrained(model, subfolder="tokenizer_3")
    for caption, embedding in zip(CAPTIONS, embeddings, strict=True):
        ids = tokenizer_3(caption, padding="max_length", max_length=256, truncation=True)["input_ids"]
        real = sum(token != tokenizer_3.pad_token_id for token in ids)
        assert embedding.length == 77 + real
        assert all(token == tokenizer_3.pad_token_id for token in ids[embedding.length - 77 :])
    assert [e.length for e in embeddings] == [77 + 6, 77 + 1, 77 + 102]  # words and the end token


def test_a_trained_lora_loads_with_the_pipelines_load_lora_weights(model: str, tmp_path: Path) -> None:
    # transcribed from train_dreambooth_lora_sd3.py (target_modules without --lora_layers)
    example = [
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    ]
    assert sorted(SPEC.denoiser.lora_targets) == sorted(example)
    trained = saved_lora(Family.SD3, model, tmp_path)
    assert not hasattr(trained.transformer_blocks[0].attn2.to_q, "lora_A")  # Medium's second attention: as there
    inputs = step_inputs(Family.SD3)
    assert_pipeline_loads_it(
        Family.SD3,
        model,
        tmp_path,
        trained,
        hidden_states=inputs.latents,
        timestep=torch.tensor([500.0, 250.0]),
        encoder_hidden_states=inputs.text["prompt_embeds"],
        pooled_projections=inputs.text["pooled_prompt_embeds"],
    )


def test_samples_come_from_cached_embeddings_with_the_empty_caption_as_negative(model: str) -> None:
    """As stk-train's sample images are made (stk.train.validation.render): no text encoder, the stored embeddings
    given, the empty caption's as the negative, the family's guidance."""
    assert SPEC.sampling.negative_prompt and (SPEC.sampling.steps, SPEC.sampling.guidance) == (28, 3.5)
    encoders = SPEC.text.encoders.load(model, torch.device("cpu"), torch.float32)
    prompt, empty = encoders.encode_text(["a photo of a cat", ""])
    embeddings = {name: torch.from_numpy(array)[None] for name, array in prompt.arrays.items()}
    embeddings |= {f"negative_{name}": torch.from_numpy(array)[None] for name, array in empty.arrays.items()}
    unused = dict.fromkeys(
        ["text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3"]
    )
    pipeline = SPEC.pipeline_class.from_pretrained(model, **unused)
    pipeline.set_progress_bar_config(disable=True)
    images = pipeline(
        **SPEC.sampling.inputs(embeddings),
        num_inference_steps=2,
        guidance_scale=SPEC.sampling.guidance,
        height=64,
        width=64,
        generator=seeded(0),
        output_type="np",
    ).images
    assert images.shape == (1, 64, 64, 3) and np.isfinite(images).all()


def pipeline_embeddings(pipeline: Any, captions: list[str]) -> dict[str, torch.Tensor]:
    """What StableDiffusion3Pipeline.encode_prompt gives for `captions`: CLIPs' 77 positions, then T5's 256 (the
    contract suite's comparison)."""
    prompt_embeds, _, pooled, _ = pipeline.encode_prompt(
        captions, captions, captions, device="cpu", do_classifier_free_guidance=False
    )
    return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}
