"""stk.models.alignment: the sides each family trains on, stk-scan's alignment for a family, and the refusal that
names the nearest valid sizes."""

from __future__ import annotations

import pytest

from stk.errors import InputError
from stk.models import Family, build_tiny_model
from stk.models.alignment import check_aligned, family_alignment, model_alignment, scan_alignment
from stk.models.families import spec_for


@pytest.mark.parametrize("family", list(Family), ids=lambda f: f.value)
def test_a_family_aligns_to_its_vae_and_patches(family: Family) -> None:
    assert family_alignment(family) == 8 * spec_for(family).latents.patch_size  # every published VAE is 8x
    assert scan_alignment(None, family) == family_alignment(family)
    assert scan_alignment(64, family) == 64


def test_the_model_read_decides_for_a_model(tmp_path) -> None:
    model = build_tiny_model(Family.SD, str(tmp_path / "sd"))
    assert model_alignment(model, Family.SD) == 8  # its tiny VAE has the published 4 blocks


def test_an_alignment_or_size_that_does_not_fit_is_refused_with_the_nearest() -> None:
    with pytest.raises(
        InputError, match=r"^--alignment 24: Flux needs bucket sides that are multiples of 16; use 16 or 32$"
    ):
        scan_alignment(24, Family.FLUX)
    check_aligned([(1024, 1024), (1008, 992)], 16, Family.FLUX, "bucket", "fix")
    with pytest.raises(
        InputError,
        match=r"^bucket 1000x1024 \(and 1 more\): Flux needs sides that are multiples of "
        r"16, nearest 992x1024 or 1008x1024; scan again$",
    ):
        check_aligned([(1024, 1024), (1032, 1024), (1000, 1024)], 16, Family.FLUX, "bucket", "scan again")
