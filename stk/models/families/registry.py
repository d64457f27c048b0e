"""The registry: the folders of this package. Each folder `stk/models/families/<name>/` that holds an `__init__.py` is a
family, named on the command line by the folder's name with `-` for `_`; a folder whose name starts with `_` (the
template) is not. Adding a family is adding its folder: nothing here changes. Listing the names reads the directory
and imports nothing heavy (the command-line choices, `import stk.models`)."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import TYPE_CHECKING

__all__ = ["DEMO_FAMILY", "Family", "family_hint", "family_names", "family_of", "module_name"]

FOLDER = Path(__file__).parent


def _folders() -> list[str]:
    """The family folders' names, sorted: the order of the command line's choices and of the docs."""
    return sorted(
        entry.name
        for entry in FOLDER.iterdir()
        if (entry / "__init__.py").is_file() and not entry.name.startswith(("_", "."))
    )


if TYPE_CHECKING:

    class Family(str, enum.Enum):
        """A family's name; its members are made from the folders, so a type checker sees none by name."""

else:
    Family = enum.Enum(
        "Family",
        {folder.upper(): folder.replace("_", "-") for folder in _folders()},
        type=str,
        module=__name__,
    )
    Family.__doc__ = "A family's name: its folder's, `_` read as `-` (`module_name` is the reverse)."

DEMO_FAMILY = Family("sdxl")  # the one the demo trains unless told otherwise


def module_name(family: Family) -> str:
    """The family's package in stk.models.families: a package name cannot hold the `-` a family's name may."""
    return family.value.replace("-", "_")


def family_of(module: str) -> Family:
    """The family whose folder holds `module` (a module's `__name__`): a family's code names itself by where it is."""
    folder = module.removeprefix(__package__ + ".").split(".")[0]
    return Family(folder.replace("_", "-"))


def family_names() -> list[str]:
    return [family.value for family in Family]


def family_hint() -> str:
    return "pass --family " + "|".join(family_names())
