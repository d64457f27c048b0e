"""What is particular to Z-Image, on its tiny pipeline, fp32 on the CPU: one step's loss and gradients are those of
diffusers' examples/dreambooth/train_dreambooth_lora_z_image.py, the tokenizer renders Qwen3's chat template, and the
sigmas are shifted as its scheduler's static shift. (What every family keeps, its encode_prompt, LoRA and samples
included: tests/unit/models/test_contract.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from diffusers import ZImagePipeline
from support.family_tests import EncodedText
from support.reference_steps import assert_matches_reference, example_flow_loss
from torch.nn.utils.rnn import pad_sequence

from stk.models import Family
from stk.models.families import spec_for
from stk.models.interface import StepInputs
from stk.models.textmask import TEXT_MASK
from stk.train.data.batch import collate_text
from stk.train.objective.losses import sample_u
from stk.train.objective.objectives import objective_for

SPEC = spec_for(Family.ZIMAGE)
CAPTIONS = ["a photo of a cat", "A red dog, on the painting with a blue man!"]  # two lengths: the mask matters
CPU = torch.device("cpu")


# the contract suite's captions as the encoders give them: Qwen3's real tokens (32 wide) of the caption in the chat
# template, which adds 18
ENCODED = EncodedText(
    shapes={"prompt_embeds": (512, 32), TEXT_MASK: (512, 1)},
    long_caption_tokens=119,
)


@pytest.fixture(scope="module")
def model(tiny_model: Callable[[Family], str]) -> str:
    return tiny_model(Family.ZIMAGE)


def test_one_step_is_train_dreambooth_lora_z_image(model: str) -> None:
    """On encoded images and captions of two lengths: the latents are the example's, and so are the loss and
    gradients, its transformer given the pipeline's own per-caption embeddings."""
    pipe = ZImagePipeline.from_pretrained(model)
    encoders = SPEC.text.encoders.load(model, CPU, torch.float32)
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


def pipeline_embeddings(pipeline: Any, captions: list[str]) -> dict[str, torch.Tensor]:
    """ZImagePipeline.encode_prompt's list of each caption's real tokens, zero-padded to the longest, with its mask
    (the contract suite's comparison)."""
    prompt_embeds, _ = pipeline.encode_prompt(list(captions), "cpu", do_classifier_free_guidance=False)
    lengths = torch.tensor([len(e) for e in prompt_embeds])
    real = torch.arange(int(lengths.max()))[None, :, None] < lengths[:, None, None]
    return {"prompt_embeds": pad_sequence(prompt_embeds, batch_first=True), TEXT_MASK: real.float()}
