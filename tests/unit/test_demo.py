"""`python -m stk.demo`: what it refuses before any work."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from stk.demo import MIN_STEPS, main


def test_too_few_steps_for_the_damaged_checkpoint_are_refused_before_any_work(tmp_path: Path) -> None:
    workdir = tmp_path / "demo-output"
    workdir.mkdir()
    (workdir / "kept").write_text("an earlier demo's output")
    result = CliRunner().invoke(main, ["--dir", str(workdir), "--steps", str(MIN_STEPS - 1)])
    assert result.exit_code == 2, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert "'--steps': 10 is too few" in error and "give at least 11" in error, error
    assert (workdir / "kept").exists()  # the directory is replaced only by a demo that will run
