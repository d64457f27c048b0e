"""stk.models.published: the published configs of SD 1.5, SDXL base and FLUX.1-dev build, on the meta device, the
architectures with the published parameter counts; and stk.models.tiny builds a loadable pipeline around them."""

from __future__ import annotations

import pytest

from stk.models.published import PUBLISHED, build_published, published_config

# the hub models' own counts (denoiser, VAE)
COUNTS = {
    "sd15": (859_520_964, 83_653_863),
    "sdxl": (2_567_463_684, 83_653_863),
    "flux-dev": (11_901_408_320, 83_819_683),
    "chroma1": (8_900_000_000, 83_819_683),  # the card's "8.9 billion"; the VAE is FLUX.1's
    # the card says 6B; the transformer's safetensors index totals 24,619,634,944 bytes of float32; FLUX.1's VAE
    "zimage": (6_154_908_736, 83_819_683),
}
# counts a model card gives rounded (not the hub's exact number): how far the built count may be from it
CARD_ROUNDING = {("chroma1", "denoiser"): 50_000_000}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_published_config_builds_the_published_parameter_count(name):
    for component, expected in zip(("denoiser", "vae"), COUNTS[name], strict=True):
        model = build_published(published_config(name, component))
        count = sum(p.numel() for p in model.parameters())
        assert abs(count - expected) <= CARD_ROUNDING.get((name, component), 0), (name, component, count)
        assert all(p.device.type == "meta" for p in model.parameters())


def test_overrides_change_the_config_and_unknown_names_are_refused():
    config = published_config("flux-dev", "denoiser", num_layers=2, num_single_layers=3)
    model = build_published(config)
    assert (len(model.transformer_blocks), len(model.single_transformer_blocks)) == (2, 3)
    assert published_config("flux-dev", "denoiser")["num_layers"] == 19  # the file is untouched
    for name, component in (("sd3", "denoiser"), ("sdxl", "unet")):
        with pytest.raises(ValueError, match="no published config"):
            published_config(name, component)
