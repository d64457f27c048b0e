"""Every exception class stk defines survives the trip between ranks: World sends a rank's error to the others pickled
(root_call, run_everywhere, split_work's gather), and one that cannot be unpickled turns the error line into a
TypeError traceback on the receiving rank. The classes are found by walking the package, so a new one is checked too."""

from __future__ import annotations

import importlib
import inspect
import pickle
from pathlib import Path

import pytest

import stk
from stk.cluster.world import failed_rank, raised_everywhere
from stk.shards.manifest import ManifestDamaged


def _exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in a module of the stk package (not the family template, which is copied, never
    imported)."""
    found: dict[str, type[BaseException]] = {}
    root = Path(stk.__file__).parent
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if "_template" in parts:
            continue
        for name, value in vars(importlib.import_module(module)).items():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module:
                found[f"{module}.{name}"] = value
    return [found[name] for name in sorted(found)]


def _instance(cls: type[BaseException]) -> BaseException:
    """An instance made as stk's code makes one: each required argument a string naming it."""
    try:
        parameters = list(inspect.signature(cls).parameters.values())
    except ValueError:  # Exception's own __init__: any arguments
        return cls("a message")
    required = [
        p for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return cls(*(f"the {p.name}" for p in required)) if required else cls("a message")


CLASSES = _exception_classes()


def test_the_walk_finds_the_classes_that_failed_before() -> None:
    """ManifestDamaged(location, why) and ImageError(kind, reason) could not be unpickled (each __init__ takes two
    arguments and gave Exception one)."""
    names = {cls.__name__ for cls in CLASSES}
    assert {"ManifestDamaged", "ImageError", "PreprocessError", "InputError", "NotAFileError"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_exception_class_unpickles_whole(cls: type[BaseException]) -> None:
    exc = _instance(cls)
    raised_everywhere(exc, 1, "node2")  # type: ignore[arg-type]  # what World adds before sending it
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls
    assert str(back) == str(exc)
    assert back.args == exc.args
    assert vars(back) == vars(exc)
    assert failed_rank(back) == (1, "node2")


def test_a_damaged_manifest_keeps_its_fields_and_its_fix() -> None:
    back = pickle.loads(pickle.dumps(ManifestDamaged("cache/manifest.json", "not JSON: Expecting value")))
    assert (back.location, back.why) == ("cache/manifest.json", "not JSON: Expecting value")
    assert "stk-cache verify cache --repair" in str(back)
