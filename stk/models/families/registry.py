"""The registry: one line per model family stk trains. The value is the family's name on the command line and, with
`_` for `-`, its module's in this package;
listing the names imports nothing heavy (the command-line choices, `import stk.models`)."""

from __future__ import annotations

import enum

__all__ = ["DEMO_FAMILY", "Family", "family_hint", "family_names", "module_name"]


class Family(str, enum.Enum):
    """A family's name; the value, `-` read as `_`, is its module's (`module_name`)."""

    SD = "sd"  # Stable Diffusion 1.x and 2.x
    SDXL = "sdxl"
    FLUX = "flux"  # FLUX.1
    SD3 = "sd3"  # Stable Diffusion 3.5 Large and Medium
    CHROMA = "chroma"  # Chroma1 (lodestones)
    ZIMAGE = "zimage"  # Z-Image
    FLUX2 = "flux2"  # FLUX.2-dev (with what it shares with FLUX.2-klein: flux2.py)
    FLUX2_KLEIN = "flux2-klein"  # FLUX.2-klein 4B and 9B (what it shares with FLUX.2-dev: flux2.py)
    QWENIMAGE = "qwenimage"  # Qwen-Image


DEMO_FAMILY = Family.SDXL  # the one the demo trains unless told otherwise


def module_name(family: Family) -> str:
    """The family's module in stk.models.families: a module name cannot hold the `-` a family's name may."""
    return family.value.replace("-", "_")


def family_names() -> list[str]:
    return [family.value for family in Family]


def family_hint() -> str:
    return "pass --family " + "|".join(family_names())
