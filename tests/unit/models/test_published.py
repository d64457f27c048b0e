"""stk.models.published: the published configs of SD 1.5, SDXL base, FLUX.1-dev, SD3.5 Large and Medium, Chroma1,
Z-Image, FLUX.2-dev, FLUX.2-klein 4B and 9B and Qwen-Image build, on the meta device, the architectures with the
published parameter counts; and stk.models.tiny builds a loadable pipeline around them."""

from __future__ import annotations

import pytest
import torch

from stk.models.published import PUBLISHED, build_published, published_config

# the hub models' own counts (denoiser, VAE); a string is the model card's rounded figure (no exact count published)
COUNTS = {
    "sd15": (859_520_964, 83_653_863),
    "sdxl": (2_567_463_684, 83_653_863),
    "flux-dev": (11_901_408_320, 83_819_683),
    "sd35-large": ("8.1B", 83_819_683),  # the card's 8.1B counts the stored position table: 8.06B parameters + 0.09B
    "sd35-medium": ("2.5B", 83_819_683),  # the card's 2.5B likewise: 2.24B parameters + 0.23B position table
    "chroma1": ("8.9B", 83_819_683),  # the card's "8.9 billion"; the VAE is FLUX.1's
    # the card says 6B; the transformer's safetensors index totals 24,619,634,944 bytes of float32; FLUX.1's VAE
    "zimage": (6_154_908_736, 83_819_683),
    # the card's "32B" (32.22B); the VAE is FLUX.2's (below)
    "flux2-dev": ("32B", 84_046_372),
    # the sizes FLUX.2-klein is named by (no exact count published); the VAE is FLUX.2's: 84,046,115 parameters and its
    # batch norm's running mean and variance (2 x 128) and batch count
    "flux2-klein-4b": ("4B", 84_046_372),
    "flux2-klein-9b": ("9B", 84_046_372),
    # the card's "20B" MMDiT: 20.43B parameters, 40.86 GB of bfloat16 safetensors; the card gives no count for the
    # VAE (AutoencoderKLQwenImage): its config's
    "qwen-image": ("20B", 126_892_531),
}


def stored_count(model: torch.nn.Module) -> int:
    """What the model's checkpoint holds: its parameters and persistent buffers."""
    return sum(t.numel() for t in model.state_dict().values())


def matches(count: int, expected: int | str) -> bool:
    """An exact count, or a card's "8.1B" within its rounding (half its last digit)."""
    if isinstance(expected, int):
        return count == expected
    digits = expected.removesuffix("B")
    unit = 10 ** (9 - len(digits.partition(".")[2]))  # the last digit's worth: 0.1B
    return 2 * abs(count - int(digits.replace(".", "")) * unit) <= unit


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_published_config_builds_the_published_parameter_count(name):
    for component, expected in zip(("denoiser", "vae"), COUNTS[name], strict=True):
        model = build_published(published_config(name, component))
        assert matches(stored_count(model), expected), (name, component, stored_count(model))
        assert all(p.device.type == "meta" for p in model.parameters())


def test_a_cards_rounded_count_allows_its_rounding_only():
    assert matches(8_146_280_768, "8.1B") and matches(2_469_663_936, "2.5B")
    assert not matches(2_243_171_520, "2.5B")  # Medium without its position table
    assert not matches(8_150_000_001, "8.1B") and matches(8_150_000_000, "8.1B")


def test_overrides_change_the_config_and_unknown_names_are_refused():
    config = published_config("flux-dev", "denoiser", num_layers=2, num_single_layers=3)
    model = build_published(config)
    assert (len(model.transformer_blocks), len(model.single_transformer_blocks)) == (2, 3)
    assert published_config("flux-dev", "denoiser")["num_layers"] == 19  # the file is untouched
    for name, component in (("sd3", "denoiser"), ("sdxl", "unet")):
        with pytest.raises(ValueError, match="no published config"):
            published_config(name, component)
