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
import pytest

from stk.errors import InputError
from stk.models import Encoders, Family, build_tiny_model, detect_family, load_encoders
from stk.models.base import identity_differences

CAPTIONS = ["a photo of a cat", "A red dog, on the painting!", "the " * 100 + "cat"]  # the last overflows CLIP's 77


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tiny_model: Callable[[Family], str]) -> Callable[..., str]:
    """tiny(family, seed=0) -> the directory of that tiny model, built on first use (seed 0: the session's)."""
    built: dict[tuple[Family, int], str] = {}

    def get(family: Family, seed: int = 0) -> str:
        if seed == 0:
            return tiny_model(family)
        if (family, seed) not in built:
            out = tmp_path_factory.mktemp(f"{family.value}-{seed}")
            built[family, seed] = build_tiny_model(family, str(out), seed=seed)
        return built[family, seed]

    return get


def test_config_identifies_the_encoders(tiny: Callable[..., str], tiny_encoders: Callable[[Family], Encoders]) -> None:
    config = tiny_encoders(Family.SD).config()
    json.dumps(config)  # JSON-able
    assert config["family"] == "sd" and config["model"] == tiny(Family.SD)
    assert load_encoders(tiny(Family.SD), device="cpu").config() == config

    other = load_encoders(tiny(Family.SD, seed=1), device="cpu").config()
    assert other["vae"] != config["vae"] and other["text"] != config["text"]


def test_a_per_channel_normalisation_that_differs_is_named_with_both_values(
    tiny_encoders: Callable[[Family], Encoders],
) -> None:
    cached = tiny_encoders(Family.QWENIMAGE).config()
    model = json.loads(json.dumps(cached))
    model["vae"]["latents_std"] = [2 * v for v in model["vae"]["latents_std"]]
    (difference,) = identity_differences(cached, model)
    std = cached["vae"]["latents_std"]
    assert difference.startswith(f"vae: latents_std [{std[0]:.4g}, {std[1]:.4g}, {std[2]:.4g}, ... (16 values)] ")
    assert difference.endswith(
        f"in the cache, [{2 * std[0]:.4g}, {2 * std[1]:.4g}, {2 * std[2]:.4g}, ... (16 values)] in the model"
    )


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
    with pytest.raises(
        InputError, match=r"'KandinskyPipeline'.*StableDiffusionXLPipeline.*--family chroma\|flux\|.*\|sdxl\|"
    ):
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
