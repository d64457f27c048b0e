"""stk.models.families.zimage on the tiny Z-Image pipeline, fp32 on the CPU: one step's loss and gradients are those of
diffusers' examples/dreambooth/train_dreambooth_lora_z_image.py, the tokenizer renders Qwen3's chat template, a trained
LoRA loads with ZImagePipeline.load_lora_weights, and sample images from cached embeddings are the pipeline's own.
(The embeddings against ZImagePipeline.encode_prompt: tests/unit/models/test_load.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import ZImagePipeline
from support.lora_files import assert_pipeline_loads_it, saved_lora
from support.reference_steps import assert_matches_reference, example_flow_loss
from support.samples import rendered_sample

from stk.models import Family, build_tiny_model
from stk.models.families import spec_for
from stk.train.batch import StepInputs, collate_text
from stk.train.losses import sample_u
from stk.train.objectives import objective_for
from stk.train.validation import ValidationPlan

SPEC = spec_for(Family.ZIMAGE)
CAPTIONS = ["a photo of a cat", "A red dog, on the painting with a blue man!"]  # two lengths: the mask matters
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(Family.ZIMAGE, str(tmp_path_factory.mktemp("zimage")))


def test_one_step_is_train_dreambooth_lora_z_image(model: str) -> None:
    """On encoded images and captions of two lengths: the latents are the example's, and so are the loss and
    gradients, its transformer given the pipeline's own per-caption embeddings."""
    pipe = ZImagePipeline.from_pretrained(model)
    encoders = SPEC.encoders.load(model, CPU, torch.float32)
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        prompt_embeds, _ = pipe.encode_prompt(list(CAPTIONS), CPU, do_classifier_free_guidance=False)
        mode = pipe.vae.encode(pixels).latent_dist.mode()
    mean, _ = encoders.encode_images(pixels)
    inputs = StepInputs(
        latents=encoders.norm.normalize(mean),
        text=collate_text([e.arrays for e in encoders.encode_text(CAPTIONS)]),
        original_size=torch.tensor([[64, 48]] * 2),
        crop_top_left=torch.zeros(2, 2, dtype=torch.long),
    )
    torch.testing.assert_close(inputs.latents, (mode - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor)
    assert len(prompt_embeds[0]) != len(prompt_embeds[1])

    def reference(transformer: torch.nn.Module, batch: StepInputs, noise: torch.Tensor, sigmas: torch.Tensor):
        model_input = batch.latents
        timesteps = sigmas * 1000  # the example indexes the scheduler's timesteps; stk draws them continuously
        sigmas = sigmas.view(-1, 1, 1, 1)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        timestep_normalized = (1000 - timesteps) / 1000
        noisy_model_input_5d = noisy_model_input.unsqueeze(2)
        noisy_model_input_list = list(noisy_model_input_5d.unbind(dim=0))
        model_pred_list = transformer(noisy_model_input_list, timestep_normalized, prompt_embeds, return_dict=False)[0]
        model_pred = torch.stack(model_pred_list, dim=0)
        model_pred = model_pred.squeeze(2)
        model_pred = -model_pred
        return example_flow_loss(model_pred, noise, model_input, sigmas)

    objective = objective_for(Family.ZIMAGE, model)
    assert_matches_reference(objective, objective.load_denoiser(torch.float32), reference, inputs)


def test_sigmas_are_shifted_as_the_schedulers_static_shift(model: str) -> None:
    """Tongyi-MAI/Z-Image's scheduler: shift 6 at every resolution (no dynamic shifting), in the table the example
    indexes with uniform draws."""
    objective = objective_for(Family.ZIMAGE, model)
    u = sample_u(objective.settings, "uniform", 64, torch.Generator().manual_seed(3))
    unshifted = (1000 - (u * 1000).long()) / 1000
    for image_tokens in (16, 4096):
        drawn = objective.sigmas(64, image_tokens, torch.Generator().manual_seed(3))
        torch.testing.assert_close(drawn, 6 * unshifted / (1 + 5 * unshifted))


def test_the_tokenizer_renders_qwen3s_chat_template(model: str) -> None:
    tokenizer = ZImagePipeline.from_pretrained(model).tokenizer
    chat = [{"role": "user", "content": "a cat"}]
    thinking = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert thinking == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    plain = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert plain == thinking + "<think>\n\n</think>\n\n"
    assert tokenizer.convert_ids_to_tokens(tokenizer("<|im_start|> cat")["input_ids"]) == ["<|im_start|>", "Ġcat"]


def test_a_trained_lora_loads_into_the_pipeline(model: str, tmp_path: Path) -> None:
    trained = saved_lora(Family.ZIMAGE, model, tmp_path)
    g = torch.Generator().manual_seed(2)
    x, caption = [torch.randn(16, 1, 8, 6, generator=g)], [torch.randn(5, 32, generator=g)]
    assert_pipeline_loads_it(Family.ZIMAGE, model, tmp_path, trained, x=x, t=torch.tensor([0.3]), cap_feats=caption)


def test_samples_from_cached_embeddings_are_the_pipelines_own(model: str) -> None:
    """The renderer's path (each prompt and the empty caption's stored real tokens, padded alike, then
    `sample_inputs`) gives the image that ZImagePipeline makes from the prompt's text."""
    assert SPEC.sampling.negative_prompt and SPEC.sampling.guidance > 0
    prompt = CAPTIONS[1]
    plan = ValidationPlan(prompts=(prompt,), every=0, steps=2, guidance=4.0, width=64, height=48, seed=5)
    image = rendered_sample(Family.ZIMAGE, model, plan)

    pipe = ZImagePipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    own = pipe(prompt, negative_prompt="", num_inference_steps=2, guidance_scale=4.0, width=64, height=48,
               generator=torch.Generator().manual_seed(5)).images[0]  # fmt: skip
    assert image.shape == (48, 64, 3) and image.std() > 0
    assert np.abs(image - np.asarray(own, dtype=np.int16)).max() <= 1
