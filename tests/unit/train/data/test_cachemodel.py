"""The line stk-train writes when a cache holds the latents otherwise than the family's diffusers example uses them."""

from __future__ import annotations

import pytest

from stk.models import Family
from stk.train.data.cachemodel import latents_note


@pytest.mark.parametrize("family", [Family.SD, Family.FLUX, Family.QWENIMAGE], ids=str)
def test_a_mean_only_cache_of_a_family_whose_example_samples_is_named(family: Family) -> None:
    assert latents_note(family, stored_logvar=True, cache="c") is None
    note = latents_note(family, stored_logvar=False, cache="/runs/cache")
    assert note is not None and note.startswith("/runs/cache was cached with the latent mean only")
    assert "trains on samples (stk-cache --latents params)" in note


@pytest.mark.parametrize("family", [Family.ZIMAGE, Family.FLUX2, Family.FLUX2_KLEIN], ids=str)
def test_a_sampled_cache_of_a_family_whose_example_takes_the_mode_is_named(family: Family) -> None:
    assert latents_note(family, stored_logvar=False, cache="c") is None
    note = latents_note(family, stored_logvar=True, cache="c")
    assert note is not None and "trains on the mean (stk-cache --latents mean)" in note
