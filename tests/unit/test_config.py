"""Unit tests for stk.config and for how stk-scan combines --config, environment and options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from support.commands import REPO, clean_env, scan_env
from support.slurm_cluster import free_ports

from stk.cli.scan import main as scan_main
from stk.config import load_command_config
from stk.datagen import generate_dataset
from stk.errors import ExitCode, InputError


def write_toml(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


# --- load_command_config ----------------------------------------------------------------------

CONFIG = """
[s3]
endpoint_url = "http://minio:9000"

[scan]
batch-size = 4
grad_accum = 2
min-aspect = 0.75
resolution-type = "area"
column = ["path=file_name", "caption=text"]

[cache]
batch-size = 99
"""


def test_picks_the_command_table_and_maps_dashes(tmp_path: Path) -> None:
    settings = load_command_config(write_toml(tmp_path / "stk.toml", CONFIG), "scan")
    assert settings == {
        "batch_size": 4,
        "grad_accum": 2,
        "min_aspect": 0.75,
        "resolution_type": "area",
        "column": ["path=file_name", "caption=text"],
        "s3_endpoint_url": "http://minio:9000",
    }


def test_another_command_gets_its_own_table(tmp_path: Path) -> None:
    settings = load_command_config(write_toml(tmp_path / "stk.toml", CONFIG), "cache")
    assert settings == {"batch_size": 99, "s3_endpoint_url": "http://minio:9000"}


def test_command_without_a_table_gets_only_s3(tmp_path: Path) -> None:
    assert load_command_config(write_toml(tmp_path / "stk.toml", CONFIG), "train") == {
        "s3_endpoint_url": "http://minio:9000"
    }


def test_no_s3_table(tmp_path: Path) -> None:
    path = write_toml(tmp_path / "stk.toml", "[scan]\nthreads = 3\n")
    assert load_command_config(path, "scan") == {"threads": 3}


def test_command_table_endpoint_beats_the_s3_table(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path / "stk.toml", '[s3]\nendpoint_url = "http://shared"\n[scan]\ns3-endpoint-url = "http://mine"\n'
    )
    assert load_command_config(path, "scan") == {"s3_endpoint_url": "http://mine"}


def test_empty_file(tmp_path: Path) -> None:
    assert load_command_config(write_toml(tmp_path / "stk.toml", ""), "scan") == {}


@pytest.mark.parametrize("text", ["[scan\nbatch-size = 4\n", "[scan]\nbatch-size = \n", "[scan]\nx = 'a\n", "= 3\n"])
def test_invalid_toml(tmp_path: Path, text: str) -> None:
    path = write_toml(tmp_path / "bad.toml", text)
    with pytest.raises(InputError, match="not valid TOML") as info:
        load_command_config(path, "scan")
    assert path in str(info.value)


def test_command_entry_that_is_not_a_table(tmp_path: Path) -> None:
    path = write_toml(tmp_path / "stk.toml", "scan = 3\n")
    with pytest.raises(InputError, match=r"\[scan\] must be a table"):
        load_command_config(path, "scan")


def test_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.toml")
    with pytest.raises(InputError, match="--config") as info:
        load_command_config(path, "scan")
    assert path in str(info.value)


def test_example_config_in_the_repository_loads() -> None:
    example = REPO / "etc" / "stk.toml"
    assert example.is_file(), "etc/stk.toml, the documented example config, is missing"
    settings = load_command_config(str(example), "scan")
    assert settings, "the [scan] table of etc/stk.toml is empty"
    assert all("-" not in key for key in settings)
    # every key must be an option of stk-scan, or click would ignore it silently
    options = {p.name for p in scan_main.params}
    assert set(settings) <= options, set(settings) - options


# --- stk-scan: command line > environment > --config > default ----------------------------------------


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny") / "images"
    generate_dataset(str(root), 6)
    return root


def run_scan_cli(source: Path, out: Path, *args: str, env: dict[str, str | None] | None = None) -> Result:
    runner = CliRunner()
    return runner.invoke(
        scan_main,
        [str(source), "--out", str(out), "--allow-oversubscription", "-q", *args],
        env=env if env is not None else clean_env(),
        catch_exceptions=False,
    )


def buckets_json(out: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((out / "buckets.json").read_text())
    return document


@pytest.mark.usefixtures("keep_logging")
class TestPrecedence:
    def test_default(self, tiny_dataset: Path, tmp_path: Path) -> None:
        result = run_scan_cli(tiny_dataset, tmp_path / "out")
        assert result.exit_code == 0, result.output
        doc = buckets_json(tmp_path / "out")
        assert (doc["batch_size"], doc["grad_accum"], doc["gpus"]) == (1, 1, 1)
        summary = json.loads(result.stdout)
        assert summary["files"] == 6

    def test_config_file(self, tiny_dataset: Path, tmp_path: Path) -> None:
        config = write_toml(tmp_path / "stk.toml", "[scan]\nbatch-size = 3\ngrad-accum = 2\n[cache]\nbatch-size = 50\n")
        result = run_scan_cli(tiny_dataset, tmp_path / "out", "--config", config)
        assert result.exit_code == 0, result.output
        doc = buckets_json(tmp_path / "out")
        assert (doc["batch_size"], doc["grad_accum"], doc["effective_batch_size"]) == (3, 2, 6)

    def test_config_file_from_the_environment(self, tiny_dataset: Path, tmp_path: Path) -> None:
        config = write_toml(tmp_path / "stk.toml", "[scan]\nbatch-size = 3\n")
        result = run_scan_cli(tiny_dataset, tmp_path / "out", env=clean_env(STK_SCAN_CONFIG=config))
        assert result.exit_code == 0, result.output
        assert buckets_json(tmp_path / "out")["batch_size"] == 3

    def test_environment(self, tiny_dataset: Path, tmp_path: Path) -> None:
        result = run_scan_cli(tiny_dataset, tmp_path / "out", env=clean_env(STK_SCAN_BATCH_SIZE="5"))
        assert result.exit_code == 0, result.output
        assert buckets_json(tmp_path / "out")["batch_size"] == 5

    def test_environment_beats_config(self, tiny_dataset: Path, tmp_path: Path) -> None:
        config = write_toml(tmp_path / "stk.toml", "[scan]\nbatch-size = 3\ngrad-accum = 2\n")
        result = run_scan_cli(
            tiny_dataset, tmp_path / "out", "--config", config, env=clean_env(STK_SCAN_BATCH_SIZE="5")
        )
        assert result.exit_code == 0, result.output
        doc = buckets_json(tmp_path / "out")
        # the environment wins for batch size; the config still sets what the environment does not
        assert (doc["batch_size"], doc["grad_accum"]) == (5, 2)

    def test_command_line_beats_environment_and_config(self, tiny_dataset: Path, tmp_path: Path) -> None:
        config = write_toml(tmp_path / "stk.toml", "[scan]\nbatch-size = 3\n")
        result = run_scan_cli(
            tiny_dataset,
            tmp_path / "out",
            "--config",
            config,
            "--batch-size",
            "7",
            env=clean_env(STK_SCAN_BATCH_SIZE="5"),
        )
        assert result.exit_code == 0, result.output
        assert buckets_json(tmp_path / "out")["batch_size"] == 7

    def test_invalid_config_is_a_usage_error(self, tiny_dataset: Path, tmp_path: Path) -> None:
        config = write_toml(tmp_path / "bad.toml", "[scan\n")
        result = run_scan_cli(tiny_dataset, tmp_path / "out", "--config", config)
        assert result.exit_code == 2
        assert "not valid TOML" in result.output
        assert not (tmp_path / "out").exists()

    def test_invalid_environment_value_is_a_usage_error(self, tiny_dataset: Path, tmp_path: Path) -> None:
        result = run_scan_cli(tiny_dataset, tmp_path / "out", env=clean_env(STK_SCAN_BATCH_SIZE="zero"))
        assert result.exit_code == 2
        assert "batch-size" in result.output

    def test_unknown_key_is_a_usage_error(self, tiny_dataset: Path, tmp_path: Path) -> None:
        config = write_toml(tmp_path / "stk.toml", "[scan]\nbatch-sise = 3\n")
        result = run_scan_cli(tiny_dataset, tmp_path / "out", "--config", config)
        assert result.exit_code == 2
        assert "unknown key(s) in [scan]: batch-sise" in result.output
        assert not (tmp_path / "out").exists()

    def test_out_and_column_from_config_and_environment(self, tiny_dataset: Path, tmp_path: Path) -> None:
        config = write_toml(tmp_path / "stk.toml", f'[scan]\nout = "{tmp_path / "from-config"}"\n')
        runner = CliRunner()
        result = runner.invoke(scan_main, [str(tiny_dataset), "--config", str(config), "-q"], env=clean_env())
        assert result.exit_code == 0, result.output
        assert (tmp_path / "from-config" / "metadata.parquet").exists()
        result = runner.invoke(scan_main, [str(tiny_dataset), "-q"], env=clean_env(STK_SCAN_OUT=str(tmp_path / "env")))
        assert result.exit_code == 0, result.output
        assert (tmp_path / "env" / "metadata.parquet").exists()


# --- stk-cache: one [cache] table for build, verify and info ---------------------------------------------


def test_stk_cache_info_and_verify_take_the_cache_table(tmp_path: Path) -> None:
    """Keys of a sibling subcommand (build's --model) are not errors; the S3 settings reach
    info and verify: an endpoint where nothing listens, a 0 s budget, exit 69 naming it."""
    endpoint = f"http://127.0.0.1:{free_ports(1)[0]}"
    config = write_toml(
        tmp_path / "stk.toml",
        f'[cache]\nmodel = "m"\nbatch-size = 2\ns3-endpoint-url = "{endpoint}"\ns3-retry-seconds = 0\n',
    )
    for args in (["info", "s3://b/cache"], ["verify", "s3://b/cache"]):
        proc = subprocess.run(
            [sys.executable, "-m", "stk.cli.cache", *args, "--config", str(config)],
            capture_output=True,
            text=True,
            env=scan_env(),
            timeout=120,
        )
        assert proc.returncode == ExitCode.INFRA, proc.stderr
        assert endpoint in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_stk_cache_rejects_a_key_no_subcommand_has(tmp_path: Path) -> None:
    config = write_toml(tmp_path / "stk.toml", "[cache]\nbatch-sise = 2\n")
    proc = subprocess.run(
        [sys.executable, "-m", "stk.cli.cache", "info", str(tmp_path), "--config", str(config)],
        capture_output=True,
        text=True,
        env=scan_env(),
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown key(s) in [cache]: batch-sise" in proc.stderr, proc.stderr
