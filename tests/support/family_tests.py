"""What the contract suite (tests/unit/models/test_contract.py) reads of a family's own test module,
tests/unit/models/families/test_<name>.py: the facts and pipeline calls particular to the family."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import pytest

from stk.models import Family
from stk.models.families.registry import module_name
from support.commands import REPO

TESTS = REPO / "tests" / "unit" / "models" / "families"


@dataclass(frozen=True)
class EncodedText:
    """What the family's encoders give for the contract suite's captions: each array's shape per caption (with a
    TEXT_MASK, sequences hold each caption's kept tokens only, so their length is the embedding's), the tokenizers
    whose attention masks count the real tokens, the positions kept beside those tokens (a template's, a padding
    token), and the stored length of the long caption."""

    shapes: dict[str, tuple[int, ...]]
    long_caption_tokens: int
    tokenizers: tuple[str, ...] = ("tokenizer",)
    kept: int = 0


def family_tests(family: Family) -> ModuleType:
    """The family's own test module; a family without one fails the contract, saying what to add."""
    path = TESTS / f"test_{module_name(family)}.py"
    if not path.is_file():
        pytest.fail(f"{family.value}: add {path.relative_to(REPO)}: its ENCODED, pipeline_embeddings, reference step")
    return importlib.import_module(f"unit.models.families.test_{module_name(family)}")
