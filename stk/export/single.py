"""A full fine-tune's pipeline (stk-train's final/) as one .safetensors in the model's original layout, through the
family's conversion (`FamilySpec.export.single_file`), for the families whose layout diffusers' `from_single_file` reads
back."""

from __future__ import annotations

from pathlib import Path

from stk.errors import InputError
from stk.models.families import all_specs, spec_for

__all__ = ["single_file_families", "write_single_file"]


def single_file_families() -> list[str]:
    return [spec.name.value for spec in all_specs() if spec.export.single_file is not None]


def write_single_file(pipeline: Path, family: str, out: Path) -> None:
    """`out` (a new file): every component's weights under the original checkpoint's names."""
    spec = spec_for(family)
    if spec.export.single_file is None:
        raise InputError(
            f"--format single-file: no single-file layout for {spec.title} that diffusers reads back; "
            f"families that have one: {', '.join(single_file_families())}"
        )
    from safetensors.torch import save_file

    save_file(spec.export.single_file(pipeline), str(out), metadata={"format": "pt"})
