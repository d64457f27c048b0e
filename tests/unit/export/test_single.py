"""stk-export --format single-file read back by diffusers' `from_single_file`: the same weights as the final/ pipeline
it came from (what stk-train's full fine-tune writes: the source pipeline with its denoiser), every component of SD's
and SDXL's LDM checkpoint, the transformer of the DiT families'. FLUX.1 and Chroma have none: diffusers' readers of
their original layout fix FLUX.1's published widths, which no tiny transformer has."""

from __future__ import annotations

import shutil
from pathlib import Path

import diffusers
import pytest
import torch

from stk.errors import InputError
from stk.export import ExportOptions, Format, export
from stk.models import Family, build_tiny_model
from stk.models.families import all_specs, spec_for

SINGLE_FILE = [f for f in Family if spec_for(f).export.single_file is not None]


def configs_only(final: str, into: Path) -> str:
    """final/ without its weights: what `from_single_file(config=...)` reads configs from, so that every weight it
    loads comes from the single file."""
    return str(shutil.copytree(final, into, ignore=shutil.ignore_patterns("*.safetensors", "*.bin")))


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys(), what
    for key in sa:
        assert torch.equal(sa[key], sb[key]), f"{what}: {key}"


@pytest.mark.parametrize("family", SINGLE_FILE, ids=lambda f: f.value)
def test_from_single_file_reads_the_same_weights(family: Family, tmp_path: Path) -> None:
    final = build_tiny_model(family, str(tmp_path / "final"))
    out = tmp_path / "model.safetensors"
    export(ExportOptions(final, str(out), Format.SINGLE_FILE))
    spec = spec_for(family)
    reader = getattr(diffusers, spec.export.single_file_class)
    configs = configs_only(final, tmp_path / "configs")
    if reader is spec.pipeline_class:  # the whole pipeline
        single = reader.from_single_file(str(out), config=configs, local_files_only=True)
        own = spec.pipeline_class.from_pretrained(final)
        for name, component in own.components.items():
            if isinstance(component, torch.nn.Module):
                assert_same_weights(getattr(single, name), component, name)
    else:  # the denoiser
        assert reader is spec.denoiser.model_class
        read = reader.from_single_file(
            str(out), config=configs, subfolder=spec.denoiser.subfolder, local_files_only=True
        )
        assert_same_weights(read, reader.from_pretrained(final, subfolder=spec.denoiser.subfolder), spec.title)


def test_families_without_a_single_file_layout_are_named(tmp_path: Path) -> None:
    final = build_tiny_model(Family.FLUX, str(tmp_path / "final"))
    having = ", ".join(spec.name.value for spec in all_specs() if spec.export.single_file is not None)
    assert "sdxl" in having and "flux," not in having
    named = rf"no single-file layout for Flux .* families that have one: {having}$"
    with pytest.raises(InputError, match=named):
        export(ExportOptions(final, str(tmp_path / "m.safetensors"), Format.SINGLE_FILE))
    assert not (tmp_path / "m.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # no temporary file left
