"""What is particular to FLUX.2-dev, on its tiny pipeline (Mistral3 text encoder), fp32 on the CPU: the embeddings'
lengths count the chat with the pipeline's system message, one step's loss and gradients are those of diffusers'
examples/dreambooth/train_dreambooth_lora_flux2.py (guidance input included), and the LoRA targets are the example's.
What FLUX.2-dev shares with FLUX.2-klein (the latents' normalisation) is checked in test_flux2_klein.py; what every
family keeps, in tests/unit/models/test_contract.py."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline
from support.family_tests import EncodedText
from support.flux2_example import GUIDANCE_SCALE, assert_default_lora_targets_are_the_examples, example_step
from support.reference_steps import assert_matches_reference

from stk.errors import InputError
from stk.models import Family
from stk.models.families import spec_for
from stk.models.interface import StepInputs
from stk.train.data.batch import collate_text
from stk.train.objective.objectives import objective_for

SPEC = spec_for(Family.FLUX2)
CAPTIONS = ["a photo of a cat", "A red dog, on the painting with a blue man!"]
CPU = torch.device("cpu")


# the contract suite's captions as the encoders give them: three layers of Mistral3's 16 side by side, the padding
# kept; the pipeline's system message (143 tokens here) before the caption's 5 + 101
ENCODED = EncodedText(
    shapes={"prompt_embeds": (512, 48)},
    long_caption_tokens=249,
    kept=143,
)


@pytest.fixture(scope="module")
def model(tiny_model: Callable[[Family], str]) -> str:
    return tiny_model(Family.FLUX2)


def test_the_embeddings_are_the_pipelines_encode_prompt(model: str) -> None:
    """Layers 10, 20 and 30 of Mistral3 side by side, all 512 positions; the length counts the chat's real tokens,
    the pipeline's system message included."""
    pipe = Flux2Pipeline.from_pretrained(model)
    embeddings = SPEC.text.encoders.load(model, CPU, torch.float32).encode_text(CAPTIONS)
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


def test_a_chat_template_saved_the_older_way_is_read_and_none_is_refused(model: str, tmp_path: Path) -> None:
    """A PixtralProcessor saved before chat_template.jinja kept its template in tokenizer/chat_template.json, which
    the tokenizer alone does not read: stk reads it there; with neither file, a clear error."""
    older = tmp_path / "older"
    shutil.copytree(model, older)
    template = (older / "tokenizer" / "chat_template.jinja").read_text(encoding="utf-8")
    (older / "tokenizer" / "chat_template.jinja").unlink()
    (older / "tokenizer" / "chat_template.json").write_text(json.dumps({"chat_template": template}), encoding="utf-8")
    ours, theirs = (
        SPEC.text.encoders.load(m, CPU, torch.float32).encode_text(CAPTIONS[:1])[0] for m in (str(older), model)
    )
    assert ours.length == theirs.length
    np.testing.assert_array_equal(ours.arrays["prompt_embeds"], theirs.arrays["prompt_embeds"])
    (older / "tokenizer" / "chat_template.json").unlink()
    with pytest.raises(InputError, match=r"has no tokenizer/chat_template\.json"):
        SPEC.text.encoders.load(str(older), CPU, torch.float32)


def test_one_step_is_train_dreambooth_lora_flux2(model: str) -> None:
    """On the pipeline's own embeddings: the loss and gradients of the example's step, the guidance-distilled
    transformer given the example's default --guidance_scale (stk-train's default too)."""
    pipe = Flux2Pipeline.from_pretrained(model)
    encoders = SPEC.text.encoders.load(model, CPU, torch.float32)
    with torch.no_grad():
        prompt_embeds, text_ids = pipe.encode_prompt(list(CAPTIONS), CPU)
    inputs = StepInputs(
        latents=torch.randn(2, 8, 8, 6, generator=torch.Generator().manual_seed(1)),
        text=collate_text([e.arrays for e in encoders.encode_text(CAPTIONS)]),
        original_size=torch.tensor([[64, 48]] * 2),
        crop_top_left=torch.zeros(2, 2, dtype=torch.long),
    )
    objective = objective_for(Family.FLUX2, model)
    assert pipe.transformer.config.guidance_embeds and objective.guidance_scale == GUIDANCE_SCALE
    reference = example_step(Flux2Pipeline, prompt_embeds, text_ids)
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
    assert_default_lora_targets_are_the_examples(Family.FLUX2, model, single_blocks=48)


def pipeline_embeddings(pipeline: Any, captions: list[str]) -> dict[str, torch.Tensor]:
    """The pipeline's encode_prompt: three layers side by side, all 512 positions (the contract suite's comparison)."""
    prompt_embeds, _ = pipeline.encode_prompt(list(captions), torch.device("cpu"))
    return {"prompt_embeds": prompt_embeds}
