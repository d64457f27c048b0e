"""stk.models: detection and frozen encoders on tiny random-weight pipelines of each family, built once per module,
all on the CPU and offline."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoTokenizer

from stk.errors import InputError
from stk.models import Encoders, Family, build_tiny_model, detect_family, load_encoders
from stk.models.base import identity_differences
from stk.models.families import spec_for
from stk.models.textmask import TEXT_MASK

CAPTIONS = ["a photo of a cat", "A red dog, on the painting!", "the " * 100 + "cat"]  # the last overflows CLIP's 77
LATENT_CHANNELS = {Family.SD: 4, Family.SDXL: 4, Family.FLUX: 16, Family.SD3: 16, Family.CHROMA: 16, Family.ZIMAGE: 16,
                   Family.FLUX2: 8, Family.FLUX2_KLEIN: 8, Family.QWENIMAGE: 16}  # fmt: skip
# name -> shape per caption; widths follow tiny.py (SDXL 32 + 64, Flux T5 48 and CLIP 32, SD3.5 160 = T5's width,
# Z-Image Qwen3 32, Qwen-Image Qwen2.5-VL 32); with a TEXT_MASK the sequences hold each caption's kept tokens only
TEXT_SHAPES = {
    Family.SD: {"prompt_embeds": (77, 32)},
    Family.SDXL: {"prompt_embeds": (77, 96), "pooled_prompt_embeds": (64,)},
    Family.FLUX: {"prompt_embeds": (512, 48), "pooled_prompt_embeds": (32,)},
    Family.SD3: {"prompt_embeds": (77 + 256, 160), "pooled_prompt_embeds": (128,)},  # CLIPs' 77, then T5's 256
    Family.CHROMA: {"prompt_embeds": (512, 48), TEXT_MASK: (512, 1)},
    Family.ZIMAGE: {"prompt_embeds": (512, 32), TEXT_MASK: (512, 1)},
    Family.FLUX2: {"prompt_embeds": (512, 48)},  # three layers of Mistral3's 16, the padding kept
    Family.FLUX2_KLEIN: {"prompt_embeds": (512, 48)},  # three layers of Qwen3's 16, the padding kept
    Family.QWENIMAGE: {"prompt_embeds": (1024, 32), TEXT_MASK: (1024, 1)},
}
# the tokenizers whose attention masks count the real tokens of the longest sequence
SEQUENCE_TOKENIZERS = {
    Family.SD: ["tokenizer"],
    Family.SDXL: ["tokenizer", "tokenizer_2"],
    Family.FLUX: ["tokenizer_2"],
    Family.SD3: ["tokenizer_3"],
    Family.CHROMA: ["tokenizer"],
    Family.ZIMAGE: ["tokenizer"],  # the caption in the tokenizer's chat template
    Family.FLUX2: ["tokenizer"],  # the chat template's system turn: empty here, the pipeline's message in the cache
    Family.FLUX2_KLEIN: ["tokenizer"],
    Family.QWENIMAGE: ["tokenizer"],
}
# positions kept beside the counted tokens: SD3's 77 CLIP positions before T5's, Chroma's one padding token after,
# FLUX.2-dev's system message (143 tokens here) before, FLUX.2-klein's empty thinking block (the chat with thinking
# disabled) after; Qwen-Image's template puts a system turn
# before the chat template's user turn and drops both with the user turn's opening 3 tokens
KEPT = {Family.SD3: 77, Family.CHROMA: 1, Family.FLUX2: 143, Family.FLUX2_KLEIN: 15, Family.QWENIMAGE: -3}
# the tokens of CAPTIONS[2]: CLIP stops at 77, T5 does not (SD3.5 keeps CLIP's 77 before, Chroma one padding token
# after), Z-Image's chat template adds 18, FLUX.2-dev's 5 + 143, FLUX.2-klein's 18 + 15, Qwen-Image's template keeps 5
# after the caption
LONG_CAPTION_TOKENS = {Family.SD: 77, Family.SDXL: 77, Family.FLUX: 102, Family.SD3: 77 + 102, Family.CHROMA: 103,
                       Family.ZIMAGE: 119, Family.FLUX2: 249, Family.FLUX2_KLEIN: 134,
                       Family.QWENIMAGE: 106}  # fmt: skip
DENOISERS = {
    Family.SD: "UNet2DConditionModel",
    Family.SDXL: "UNet2DConditionModel",
    Family.FLUX: "FluxTransformer2DModel",
    Family.SD3: "SD3Transformer2DModel",
    Family.CHROMA: "ChromaTransformer2DModel",
    Family.ZIMAGE: "ZImageTransformer2DModel",
    Family.FLUX2: "Flux2Transformer2DModel",
    Family.FLUX2_KLEIN: "Flux2Transformer2DModel",
    Family.QWENIMAGE: "QwenImageTransformer2DModel",
}

families = pytest.mark.parametrize("family", list(Family), ids=lambda f: f.value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """tiny(family, seed=0) -> the directory of that tiny model, built on first use."""
    built: dict[tuple[Family, int], str] = {}

    def get(family: Family, seed: int = 0) -> str:
        if (family, seed) not in built:
            out = tmp_path_factory.mktemp(f"{family.value}-{seed}")
            built[family, seed] = build_tiny_model(family, str(out), seed=seed)
        return built[family, seed]

    return get


@pytest.fixture(scope="module")
def encoders(tiny: Callable[..., str]) -> Callable[[Family], Encoders]:
    loaded: dict[Family, Encoders] = {}

    def get(family: Family) -> Encoders:
        if family not in loaded:
            loaded[family] = load_encoders(tiny(family), device="cpu")
        return loaded[family]

    return get


@families
def test_detect_family(family: Family, tiny: Callable[..., str]) -> None:
    assert detect_family(tiny(family)) is family


@families
def test_loads_frozen_on_cpu(family: Family, encoders: Callable[[Family], Encoders]) -> None:
    enc = encoders(family)
    assert enc.family is family
    assert enc.device == torch.device("cpu") and enc.dtype == torch.float32
    assert enc.latent_channels == LATENT_CHANNELS[family]
    assert enc.text_outputs == tuple(TEXT_SHAPES[family])
    # the flow families' VAEs shift (FLUX.1's, SD3's) or normalise per channel (FLUX.2's, Qwen-Image's); SD's do neither
    assert (enc.norm.shift_factor is not None or enc.norm.mean is not None) == spec_for(family).flow
    assert not any(p.requires_grad for p in enc.vae.parameters())


@families
def test_encode_images_is_the_vae_distribution(
    family: Family, tiny: Callable[..., str], encoders: Callable[[Family], Encoders]
) -> None:
    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    enc = encoders(family)
    mean, logvar = enc.encode_images(pixels)

    assert mean.shape == logvar.shape == (2, LATENT_CHANNELS[family], 8, 8)
    assert mean.dtype == logvar.dtype == torch.float32 and mean.device.type == "cpu"
    vae = spec_for(family).vae_class.from_pretrained(tiny(family), subfolder="vae")
    with torch.no_grad():  # a video VAE: one frame in, the frame axis left out
        expected = vae.encode(pixels[:, :, None] if enc.vae_frames else pixels).latent_dist
    frame = (slice(None), slice(None), 0) if enc.vae_frames else ()
    torch.testing.assert_close(mean, expected.mean[frame])  # unscaled, unshifted
    torch.testing.assert_close(logvar, expected.logvar[frame])


@families
def test_encode_text_shapes_and_lengths(
    family: Family, tiny: Callable[..., str], encoders: Callable[[Family], Encoders]
) -> None:
    enc = encoders(family)
    embeddings = enc.encode_text(CAPTIONS)

    assert len(embeddings) == len(CAPTIONS)
    for caption, embedding in zip(CAPTIONS, embeddings, strict=True):
        shapes = TEXT_SHAPES[family]
        if TEXT_MASK in shapes:
            shapes = {k: (embedding.length, *shape[1:]) if len(shape) == 2 else shape for k, shape in shapes.items()}
        assert {k: v.shape for k, v in embedding.arrays.items()} == shapes
        assert all(v.dtype == np.float32 for v in embedding.arrays.values())
        masks = []
        for subfolder in SEQUENCE_TOKENIZERS[family]:
            tokenizer = AutoTokenizer.from_pretrained(tiny(family), subfolder=subfolder)
            sequence = TEXT_SHAPES[family]["prompt_embeds"][0]
            text = caption
            if tokenizer.chat_template:
                chat = [{"role": "user", "content": caption}]
                text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            masks.append(sum(tokenizer(text, max_length=sequence, truncation=True)["attention_mask"]))
        assert embedding.length == max(masks) + KEPT.get(family, 0)
    assert embeddings[2].length == LONG_CAPTION_TOKENS[family]
    assert enc.encode_text([]) == []


@families
def test_encode_text_is_deterministic_and_batch_independent(
    family: Family, encoders: Callable[[Family], Encoders]
) -> None:
    enc = encoders(family)
    first, again, alone = enc.encode_text(CAPTIONS), enc.encode_text(CAPTIONS), enc.encode_text(CAPTIONS[1:2])
    for a, b in zip(first, again, strict=True):
        assert a.length == b.length
        assert all(np.array_equal(a.arrays[k], b.arrays[k]) for k in a.arrays)
    for name, array in alone[0].arrays.items():
        np.testing.assert_allclose(array, first[1].arrays[name], atol=1e-5)


@families
def test_matches_the_diffusers_pipeline(
    family: Family, tiny: Callable[..., str], encoders: Callable[[Family], Encoders]
) -> None:
    """The tiny model loads as a whole pipeline, denoiser included, and our embeddings are its encode_prompt's."""
    pipeline = DiffusionPipeline.from_pretrained(tiny(family))
    denoiser = getattr(pipeline, spec_for(family).denoiser_subfolder)
    assert type(denoiser).__name__ == DENOISERS[family]

    embeddings = encoders(family).encode_text(CAPTIONS)
    # zero-padded to the longest where only the real tokens are stored (TEXT_MASK)
    ours = {
        k: pad_sequence([torch.from_numpy(e.arrays[k]) for e in embeddings], batch_first=True)
        for k in TEXT_SHAPES[family]
    }
    with torch.no_grad():
        if family is Family.SD:
            prompt_embeds, _ = pipeline.encode_prompt(CAPTIONS, "cpu", 1, False)
            expected = {"prompt_embeds": prompt_embeds}
        elif family is Family.SDXL:
            prompt_embeds, _, pooled, _ = pipeline.encode_prompt(
                CAPTIONS, device="cpu", do_classifier_free_guidance=False
            )
            expected = {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}
        elif family is Family.FLUX:
            prompt_embeds, pooled, _ = pipeline.encode_prompt(CAPTIONS, CAPTIONS, device="cpu")
            expected = {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}
        elif family is Family.ZIMAGE:  # a list of each caption's real tokens
            prompt_embeds, _ = pipeline.encode_prompt(list(CAPTIONS), "cpu", do_classifier_free_guidance=False)
            lengths = torch.tensor([len(e) for e in prompt_embeds])
            real = torch.arange(int(lengths.max()))[None, :, None] < lengths[:, None, None]
            expected = {"prompt_embeds": pad_sequence(prompt_embeds, batch_first=True), TEXT_MASK: real.float()}
        elif family is Family.QWENIMAGE:  # zero-padded to the longest, with its mask
            prompt_embeds, mask = pipeline.encode_prompt(CAPTIONS, "cpu")
            expected = {"prompt_embeds": prompt_embeds, TEXT_MASK: mask[..., None].float()}
        else:
            pytest.skip(f"compared in tests/unit/models/families/test_{family.value}.py")
    for name, tensor in expected.items():
        torch.testing.assert_close(ours[name], tensor, atol=1e-4, rtol=1e-4)


def test_config_identifies_the_encoders(tiny: Callable[..., str], encoders: Callable[[Family], Encoders]) -> None:
    config = encoders(Family.SD).config()
    json.dumps(config)  # JSON-able
    assert config["family"] == "sd" and config["model"] == tiny(Family.SD)
    assert load_encoders(tiny(Family.SD), device="cpu").config() == config

    other = load_encoders(tiny(Family.SD, seed=1), device="cpu").config()
    assert other["vae"] != config["vae"] and other["text"] != config["text"]


@families
def test_the_identity_is_had_without_the_text_encoders_weights(
    family: Family, tiny: Callable[..., str], encoders: Callable[[Family], Encoders]
) -> None:
    """stk-train's check of a cache's model (the meta device): the text encoders are built without weights, their
    digests read from their files, and the identity is the loaded encoders'."""
    identity = load_encoders(tiny(family), device="meta", dtype=torch.float32)
    assert all(p.device.type == "meta" for encoder in identity.text for p in encoder.model.parameters())
    assert identity.vae.device.type == "cpu"
    assert identity.config() == encoders(family).config()


def test_a_per_channel_normalisation_that_differs_is_named_with_both_values(
    encoders: Callable[[Family], Encoders],
) -> None:
    cached = encoders(Family.QWENIMAGE).config()
    model = json.loads(json.dumps(cached))
    model["vae"]["latents_std"] = [2 * v for v in model["vae"]["latents_std"]]
    (difference,) = identity_differences(cached, model)
    std = cached["vae"]["latents_std"]
    assert difference.startswith(f"vae: latents_std [{std[0]:.4g}, {std[1]:.4g}, {std[2]:.4g}, ... (16 values)] ")
    assert difference.endswith(f"in the cache, [{2 * std[0]:.4g}, {2 * std[1]:.4g}, {2 * std[2]:.4g}, ... "
                               "(16 values)] in the model")  # fmt: skip


def test_config_changes_when_weights_change_in_place(tmp_path: Path) -> None:
    path = build_tiny_model(Family.SD, str(tmp_path / "model"), seed=2)
    before = load_encoders(path, device="cpu").config()
    build_tiny_model(Family.SD, path, seed=3)  # same path, same architecture, other weights
    after = load_encoders(path, device="cpu").config()
    assert after["vae"]["config_sha256"] == before["vae"]["config_sha256"]
    assert after["vae"] != before["vae"] and after["text"] != before["text"]


def test_same_seed_builds_the_same_model(tmp_path: Path, tiny: Callable[..., str]) -> None:
    again = load_encoders(build_tiny_model(Family.SD, str(tmp_path / "again")), device="cpu").config()
    original = load_encoders(tiny(Family.SD), device="cpu").config()
    assert again["vae"] == original["vae"] and again["text"] == original["text"]


def test_empty_tokenizer_is_refused(tmp_path: Path, tiny: Callable[..., str]) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny(Family.SD), model)
    shutil.rmtree(model / "tokenizer")
    (model / "tokenizer").mkdir()
    with pytest.raises(InputError, match=r"tokenizer in .*/tokenizer loaded empty \(vocab size 2\)"):
        load_encoders(str(model), device="cpu")


def test_wrong_family_is_refused(tiny: Callable[..., str]) -> None:
    """An SD model has no tokenizer_2/text_encoder_2 for Flux's T5."""
    with pytest.raises(InputError, match="tokenizer_2"):
        load_encoders(tiny(Family.SD), Family.FLUX, device="cpu")


def test_unknown_pipeline_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(InputError, match=r"'KandinskyPipeline'.*StableDiffusionXLPipeline.*--family sd\|sdxl\|flux"):
        detect_family(str(tmp_path))


def test_not_a_pipeline_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"no model_index\.json"):
        detect_family(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(InputError, match="is a file"):
        detect_family(str(tmp_path / "model.safetensors"))


def test_uncached_hub_id_offline_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(InputError, match=r"'stk-test/no-such-model'.*local model directory"):
        detect_family("stk-test/no-such-model")


def test_import_does_not_load_torch() -> None:
    code = "import sys, stk.models; assert 'torch' not in sys.modules and 'diffusers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
