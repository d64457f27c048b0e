"""The model families: the registry (one line each in `Family`, registry.py), and everything stk knows about a
family in its own module, stk/models/families/<name>.py, as one `FamilySpec` named SPEC (published configs in
stk/models/configs/<name>/). Code outside this package asks a family's spec and never names a family.

Listing the names is cheap (the command-line choices, `import stk.models`); a spec imports torch, diffusers and
transformers on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from stk.errors import InputError
from stk.models.families.registry import DEMO_FAMILY, Family, family_hint, family_names, module_name

if TYPE_CHECKING:
    from stk.models.families.spec import FamilySpec

__all__ = ["DEMO_FAMILY", "Family", "all_specs", "detect_family", "family_hint", "family_names", "spec_for"]


def spec_for(family: Family | str) -> FamilySpec:
    """Everything stk knows about `family` (a `Family` or its name)."""
    spec: FamilySpec = importlib.import_module(f"{__name__}.{module_name(Family(family))}").SPEC
    return spec


def all_specs() -> list[FamilySpec]:
    """Every family's spec, in the registry's order."""
    return [spec_for(family) for family in Family]


def detect_family(model: str) -> Family:
    """The family of `model` (a local diffusers directory or a hub id), from the pipeline class its model_index.json
    names; variants of one pipeline (img2img, inpainting) share its family."""
    from stk.models.model_json import read_model_json  # it names the families in its hints: imported on use

    name = read_model_json(model, "model_index.json").get("_class_name")
    for spec in all_specs():
        if name in spec.pipelines:
            return spec.name
    known = ", ".join(pipeline for spec in all_specs() for pipeline in spec.pipelines)
    raise InputError(
        f"{model}: pipeline {name!r} is not one stk knows ({known}); {family_hint()} if its VAE and text encoders "
        "are laid out like one of those"
    )
