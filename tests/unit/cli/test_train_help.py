"""stk-train --help: the options whose default is each family's own name every family's, from its spec."""

from __future__ import annotations

import re

from click.testing import CliRunner

from stk.cli.train import main
from stk.models.families import all_specs


def _help_of(option: str) -> str:
    """One option's help in `stk-train --help`, on one line (wide enough that no family's title is broken)."""
    result = CliRunner().invoke(main, ["--help"], terminal_width=10_000, max_content_width=10_000)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {option} "))
    rest = lines[start + 1 :]
    end = next(i for i, line in enumerate(rest) if line.startswith("  -"))
    return " ".join([lines[start], *rest[:end]])


def _names(help_text: str, title: str, value: object) -> bool:
    """Whether the help's list of defaults has `title value` as one of its entries."""
    return re.search(rf"(: |, ){re.escape(title)} {re.escape(str(value))}[,\]]", help_text) is not None


def test_the_sample_steps_of_every_family_are_named_from_its_spec() -> None:
    help_text = _help_of("--validation-steps")
    for spec in all_specs():
        assert _names(help_text, spec.title, spec.sampling.steps), (spec.name.value, help_text)


def test_the_sample_guidance_of_every_family_is_named_from_its_spec() -> None:
    help_text = _help_of("--validation-guidance")
    without_negative = help_text.partition("except for")[2]
    for spec in all_specs():
        assert _names(help_text, spec.title, f"{spec.sampling.guidance:g}"), (spec.name.value, help_text)
        assert (f" {spec.title}," in without_negative) != spec.sampling.negative_prompt, (spec.name.value, help_text)
