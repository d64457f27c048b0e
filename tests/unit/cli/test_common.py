"""stk.cli.common's FiniteFloat, the type of every float option: nan and inf refused at parse time in one line, from
the command line, the environment and a config file alike; and the bucket sizes no model takes refused before a scan
starts. In-process, through click's runner."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result
from support.commands import clean_env

from stk.cli.common import FiniteFloat
from stk.cli.scan import main as scan_main
from stk.cli.train import main as train_main
from stk.errors import ExitCode

pytestmark = pytest.mark.usefixtures("keep_logging")


def _usage_error(result: Result, option: str, value: str) -> None:
    """Exit 2 and click's one Error line naming the option and the value, no traceback."""
    assert result.exit_code == ExitCode.USAGE, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: Invalid value for '{option}': {value} is not a finite number"], result.stderr
    assert "Traceback" not in result.stderr


def _train(*args: str, **env: str) -> Result:
    argv = ["--model", "unused", "--output-dir", "unused", *args]
    return CliRunner().invoke(train_main, argv, env=clean_env(**env), catch_exceptions=False)


@pytest.mark.parametrize(
    ("args", "option", "value"),
    [
        (["--lr", "nan"], "--lr", "nan"),
        (["--lr", "inf"], "--lr", "inf"),
        (["--max-grad-norm", "nan"], "--max-grad-norm", "nan"),
        (["--snr-gamma", "-inf"], "--snr-gamma", "-inf"),
        (["--guidance-scale", "NaN"], "--guidance-scale", "NaN"),
        (["--betas", "0.9,nan"], "--betas", "nan"),
        (["--flow-shift", "inf"], "--flow-shift", "inf"),
        (["--s3-retry-seconds", "inf"], "--s3-retry-seconds", "inf"),
    ],
)
def test_a_float_option_that_is_not_finite_is_a_usage_error(args: list[str], option: str, value: str) -> None:
    result = _train(*args)
    assert result.exit_code == ExitCode.USAGE and option in result.stderr, result.output
    _usage_error(result, option, value)


def test_the_environment_and_a_config_file_are_checked_like_the_command_line(tmp_path: Path) -> None:
    _usage_error(_train(STK_TRAIN_LR="inf"), "--lr", "inf")
    config = tmp_path / "run.toml"
    config.write_text("[train]\nlr = nan\n")  # TOML's own nan: a float, not a string
    _usage_error(_train("--config", str(config)), "--lr", "nan")


def test_bounds_still_hold_and_an_unbounded_option_shows_no_range() -> None:
    assert FiniteFloat(0, min_open=True).convert("1e-4", None, None) == 1e-4
    with pytest.raises(click.BadParameter, match="is not in the range x>0"):
        FiniteFloat(0, min_open=True).convert("0", None, None)
    assert FiniteFloat()._describe_range() == ""
    assert "x<=None" not in CliRunner().invoke(train_main, ["--help"]).output


def _scan(tmp_path: Path, *args: str) -> Result:
    argv = [str(tmp_path), "--out", str(tmp_path / "out"), *args]
    return CliRunner().invoke(scan_main, argv, env=clean_env(), catch_exceptions=False)


def test_scan_resolution_nan_is_a_usage_error_and_one_no_model_takes_is_refused_before_any_work(tmp_path: Path) -> None:
    _usage_error(_scan(tmp_path, "--resolution", "nan"), "--resolution", "nan")
    huge = _scan(tmp_path, "--resolution", "1e9")  # took 6.6 GB and kept growing
    assert huge.exit_code == ExitCode.INPUT, huge.output
    errors = [line for line in huge.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in huge.stderr, huge.stderr
    assert "resolution 1e+09 (pixel) with aspect ratios from 0.5 to 2 makes bucket sides up to 2e+09 px" in errors[0]
    assert "stk makes sides up to 65536 px" in errors[0]
    assert not (tmp_path / "out").exists()
