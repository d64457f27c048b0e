"""The contract every family keeps, run over every spec in the registry, so a new family's folder is checked with
nothing added here: its pipeline is detected and loads with the spec's denoiser, its encoders give its pipeline's own
encode_prompt, a LoRA trained on it loads with its pipeline's load_lora_weights, its sample images are the ones its
pipeline makes from the prompt's text, and a fine-tuned model exports as a pipeline that loads and runs.

What is particular to a family lives in tests/unit/models/families/test_<name>.py, which every family has: how its
pipeline's encode_prompt is called (`pipeline_embeddings`) and its training example's transcription (a test named
`test_one_step_is_<the example>`). Loading under ZeRO-3: tests/integration/test_train_weights.py."""

from __future__ import annotations

import ast
import filecmp
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from support.exported import files, perturbed
from support.family_tests import family_tests
from support.lora_files import assert_pipeline_loads_it, saved_lora
from support.samples import rendered_sample
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoTokenizer

from stk.models import Encoders, Family, detect_family, load_encoders
from stk.models.families import spec_for
from stk.models.textmask import TEXT_MASK
from stk.train.objective.objectives import objective_for
from stk.train.trainable.pipeline import export_pipeline
from stk.train.validation.plan import ValidationPlan

CAPTIONS = ["a photo of a cat", "A red dog, on the painting!", "the " * 100 + "cat"]  # the last overflows CLIP's 77
families = pytest.mark.parametrize("family", list(Family), ids=lambda f: f.value)


@families
def test_its_pipeline_is_detected_and_loads_with_the_specs_denoiser(
    family: Family, tiny_model: Callable[[Family], str]
) -> None:
    spec = spec_for(family)
    assert detect_family(tiny_model(family)) is family
    pipeline = DiffusionPipeline.from_pretrained(tiny_model(family))
    assert type(pipeline) is spec.pipeline_class
    assert type(getattr(pipeline, spec.denoiser.subfolder)) is spec.denoiser.model_class


@families
def test_its_encoders_give_the_pipelines_encode_prompt(
    family: Family, tiny_model: Callable[[Family], str], tiny_encoders: Callable[[Family], Encoders]
) -> None:
    """What the cache stores (real tokens only where the family masks padding, zero-padded here to the longest) is
    what the pipeline's encode_prompt returns for the same captions."""
    model = tiny_model(family)
    embeddings = tiny_encoders(family).encode_text(CAPTIONS)
    with torch.no_grad():
        expected = family_tests(family).pipeline_embeddings(DiffusionPipeline.from_pretrained(model), CAPTIONS)
    assert set(expected) == set(embeddings[0].arrays)
    for name, tensor in expected.items():
        ours = pad_sequence([torch.from_numpy(e.arrays[name]) for e in embeddings], batch_first=True)
        torch.testing.assert_close(ours, tensor, atol=1e-4, rtol=1e-4, msg=name)


@families
def test_loads_frozen_on_cpu(family: Family, tiny_encoders: Callable[[Family], Encoders]) -> None:
    enc = tiny_encoders(family)
    assert enc.family is family
    assert enc.device == torch.device("cpu") and enc.dtype == torch.float32
    assert enc.latent_channels == spec_for(family).tiny.latent_channels
    assert enc.text_outputs == tuple(family_tests(family).ENCODED.shapes)
    # the flow families' VAEs shift (FLUX.1's, SD3's) or normalise per channel (FLUX.2's, Qwen-Image's); SD's do neither
    assert (enc.norm.shift_factor is not None or enc.norm.mean is not None) == spec_for(family).denoiser.flow
    assert not any(p.requires_grad for p in enc.vae.parameters())


@families
def test_encode_images_is_the_vae_distribution(
    family: Family, tiny_model: Callable[[Family], str], tiny_encoders: Callable[[Family], Encoders]
) -> None:
    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    enc = tiny_encoders(family)
    mean, logvar = enc.encode_images(pixels)

    assert mean.shape == logvar.shape == (2, spec_for(family).tiny.latent_channels, 8, 8)
    assert mean.dtype == logvar.dtype == torch.float32 and mean.device.type == "cpu"
    vae = spec_for(family).latents.vae_class.from_pretrained(tiny_model(family), subfolder="vae")
    with torch.no_grad():  # a video VAE: one frame in, the frame axis left out
        expected = vae.encode(pixels[:, :, None] if enc.vae_frames else pixels).latent_dist
    frame = (slice(None), slice(None), 0) if enc.vae_frames else ()
    torch.testing.assert_close(mean, expected.mean[frame])  # unscaled, unshifted
    torch.testing.assert_close(logvar, expected.logvar[frame])


@families
def test_encode_text_shapes_and_lengths(
    family: Family, tiny_model: Callable[[Family], str], tiny_encoders: Callable[[Family], Encoders]
) -> None:
    enc = tiny_encoders(family)
    embeddings = enc.encode_text(CAPTIONS)

    assert len(embeddings) == len(CAPTIONS)
    for caption, embedding in zip(CAPTIONS, embeddings, strict=True):
        shapes = family_tests(family).ENCODED.shapes
        if TEXT_MASK in shapes:
            shapes = {k: (embedding.length, *shape[1:]) if len(shape) == 2 else shape for k, shape in shapes.items()}
        assert {k: v.shape for k, v in embedding.arrays.items()} == shapes
        assert all(v.dtype == np.float32 for v in embedding.arrays.values())
        masks = []
        for subfolder in family_tests(family).ENCODED.tokenizers:
            tokenizer = AutoTokenizer.from_pretrained(tiny_model(family), subfolder=subfolder)
            sequence = family_tests(family).ENCODED.shapes["prompt_embeds"][0]
            text = caption
            if tokenizer.chat_template:
                chat = [{"role": "user", "content": caption}]
                text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            masks.append(sum(tokenizer(text, max_length=sequence, truncation=True)["attention_mask"]))
        assert embedding.length == max(masks) + family_tests(family).ENCODED.kept
    assert embeddings[2].length == family_tests(family).ENCODED.long_caption_tokens
    assert enc.encode_text([]) == []


@families
def test_encode_text_is_deterministic_and_batch_independent(
    family: Family, tiny_encoders: Callable[[Family], Encoders]
) -> None:
    enc = tiny_encoders(family)
    first, again, alone = enc.encode_text(CAPTIONS), enc.encode_text(CAPTIONS), enc.encode_text(CAPTIONS[1:2])
    for a, b in zip(first, again, strict=True):
        assert a.length == b.length
        assert all(np.array_equal(a.arrays[k], b.arrays[k]) for k in a.arrays)
    for name, array in alone[0].arrays.items():
        np.testing.assert_allclose(array, first[1].arrays[name], atol=1e-5)


@families
def test_the_identity_is_had_without_the_text_encoders_weights(
    family: Family, tiny_model: Callable[[Family], str], tiny_encoders: Callable[[Family], Encoders]
) -> None:
    """stk-train's check of a cache's model (the meta device): the text encoders are built without weights, their
    digests read from their files, and the identity is the loaded encoders'."""
    identity = load_encoders(tiny_model(family), device="meta", dtype=torch.float32)
    assert all(p.device.type == "meta" for encoder in identity.text for p in encoder.model.parameters())
    assert identity.vae.device.type == "cpu"
    assert identity.config() == tiny_encoders(family).config()


@families
def test_its_training_step_is_checked_against_its_example(family: Family) -> None:
    module = family_tests(family)
    tree = ast.parse(Path(module.__file__ or "").read_text(encoding="utf-8"))
    steps = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert any(name.startswith("test_one_step_is_") for name in steps), f"{module.__name__}: no reference step"


@families
def test_a_trained_lora_loads_with_the_pipelines_load_lora_weights(
    family: Family, tiny_model: Callable[[Family], str], tmp_path: Path
) -> None:
    model = tiny_model(family)
    trained = saved_lora(family, model, tmp_path)
    assert_pipeline_loads_it(family, model, tmp_path, trained)


def text_arguments(pipeline: DiffusionPipeline, prompt: str) -> dict[str, Any]:
    """The pipeline called with the prompt's text, and the empty caption as the negative prompt where it takes one
    (SDXL's zeros where its config says so, as stk's samples do and the pipeline does by default)."""
    takes = "negative_prompt" in inspect.signature(type(pipeline).__call__).parameters
    zeros = bool(getattr(pipeline.config, "force_zeros_for_empty_prompt", False))
    return {"prompt": prompt, **({"negative_prompt": ""} if takes and not zeros else {})}


@families
def test_its_sample_images_are_the_ones_its_pipeline_makes(family: Family, tiny_model: Callable[[Family], str]) -> None:
    """The renderer's path (cached embeddings of the prompt and the empty caption, the spec's `sampling.inputs`, the
    guidance under the pipeline's own argument) gives the image the pipeline makes from the prompt's text (or as the
    family's test module says, `pipeline_sample_arguments`); and the guidance reaches the pipeline under that
    argument."""
    spec, model = spec_for(family), tiny_model(family)
    prompt, guidance = CAPTIONS[1], 2.5
    plan = ValidationPlan(prompts=(prompt,), every=0, steps=2, guidance=guidance, width=64, height=48, seed=5)
    image = rendered_sample(family, model, plan)

    pipeline = spec.pipeline_class.from_pretrained(model)
    pipeline.set_progress_bar_config(disable=True)
    arguments = getattr(family_tests(family), "pipeline_sample_arguments", text_arguments)(pipeline, prompt)
    own, other = (
        pipeline(
            **arguments,
            **{spec.sampling.guidance_argument: scale},
            num_inference_steps=2,
            width=64,
            height=48,
            generator=torch.Generator().manual_seed(5),
        ).images[0]
        for scale in (guidance, 1.5)
    )
    assert image.shape == (48, 64, 3) and image.std() > 0
    assert np.abs(image - np.asarray(own, dtype=np.int16)).max() <= 1
    assert not np.array_equal(np.asarray(own), np.asarray(other)), "the guidance reached the pipeline"


@families
def test_a_fine_tuned_model_exports_as_a_pipeline_that_loads_and_runs(
    family: Family, tiny_model: Callable[[Family], str], tmp_path: Path
) -> None:
    """The exported folder is the source pipeline with the new denoiser weights: the other components' files
    unchanged, the weights read back bit for bit, and the pipeline makes latents of the expected shape."""
    source = Path(tiny_model(family))
    objective = objective_for(family, str(source))
    sub = objective.denoiser_subfolder
    denoiser = objective.load_denoiser(torch.float32)
    state = perturbed(denoiser, 1)
    out = tmp_path / "final"
    config = dict(getattr(denoiser, "config", {}))
    assert export_pipeline(str(source), sub, objective.denoiser_class, config, state, str(out)) == str(out)

    assert files(out, sub) == files(source, sub)
    assert all(filecmp.cmp(source / f, out / f, shallow=False) for f in files(source, sub))
    assert (out / sub / "diffusion_pytorch_model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no temp folder left

    pipeline = DiffusionPipeline.from_pretrained(str(out))
    exported = getattr(pipeline, sub).state_dict()
    assert exported.keys() == state.keys()
    assert all(torch.equal(exported[k], state[k]) for k in state)
    pipeline.set_progress_bar_config(disable=True)
    # two steps: a scheduler that stretches its schedule to a shift_terminal (Qwen-Image's) divides 0 by 0 at one
    latents = pipeline(
        prompt="a photo of a cat",
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert latents.shape == spec_for(family).tiny.pipeline_latents
    assert torch.isfinite(latents).all()
