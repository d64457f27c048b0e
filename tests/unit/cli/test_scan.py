"""stk-scan --datasets in-process: several datasets, each with its own settings, into one scan directory; the list
printed back; every kind of bad list refused in one line with exit 3 before any work."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from support.commands import clean_env

from stk.cli.scan import main as scan_main
from stk.datagen import generate_dataset
from stk.datasets import read_datasets
from stk.lease import Holder, lease_name

pytestmark = pytest.mark.usefixtures("keep_logging")

STYLE, PHOTOS = 12, 30  # images in each
SCAN_LEASE = lease_name("stk-scan")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("datasets")
    generate_dataset(str(root / "style"), STYLE, seed=1)
    generate_dataset(str(root / "photos"), PHOTOS, seed=2)
    (root / "empty").mkdir()
    return root


def _list(path: Path, *tables: str) -> Path:
    path.write_text("\n".join(f"[[dataset]]\n{table}\n" for table in tables))
    return path


def _two(root: Path, list_file: Path) -> Path:
    return _list(
        list_file,
        f'name = "style"\nsource = "{root / "style"}"\nrepeats = 10\nresolution = 128\ncrop = "random"\n'
        "caption-dropout = 0.2",
        f'name = "photos"\nsource = "{root / "photos"}"\nweight = 2.0',
    )


def _scan(*args: Any) -> Result:
    return CliRunner().invoke(scan_main, [*map(str, args), "-q"], env=clean_env(), catch_exceptions=False)


def _one_line(result: Result, code: int) -> str:
    """The run's one ERROR line, after checking it ended with `code` and no traceback."""
    assert result.exit_code == code, result.output
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_two_datasets_make_one_scan_directory_with_each_ones_settings(sources: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    common = ["--out", out, "--resolution", 64, "--alignment", 16, "--missing-caption", "filename"]
    result = _scan("--datasets", _two(sources, tmp_path / "list.toml"), *common, "--allow-oversubscription")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["images"], summary["root"]) == (STYLE + PHOTOS, "")
    assert not (out / SCAN_LEASE).exists()  # released
    assert [(d["name"], d["images"]) for d in summary["datasets"]] == [("style", STYLE), ("photos", PHOTOS)]

    table = pq.read_table(out / "metadata.parquet")
    rows = table.to_pylist()
    assert [r["dataset"] for r in rows] == ["style"] * STYLE + ["photos"] * PHOTOS  # dataset by dataset
    for row in rows:  # full locations: the datasets have roots of their own
        assert row["path"] == row["filename"] and Path(row["path"]).is_file()
        assert row["path"].startswith(str(sources / row["dataset"]) + "/")
        assert min(row["bucket_width"], row["bucket_height"]) == (128 if row["dataset"] == "style" else 64)
    for name in ("style", "photos"):  # each dataset's own, ordinary scan
        own = pq.read_table(out / "datasets" / name / "metadata.parquet")
        mine = [row["path"] for row in rows if row["dataset"] == name]
        assert [str(sources / name / path) for path in own.column("path").to_pylist()] == mine

    document = json.loads((out / "buckets.json").read_text())
    assert [b["id"] for b in document["buckets"]] == list(range(len(document["buckets"])))
    by_id = {b["id"]: b for b in document["buckets"]}
    style, photos = document["datasets"]
    assert (style["repeats"], style["weight"], style["crop"], style["caption_dropout"]) == (10, None, "random", 0.2)
    assert (photos["repeats"], photos["weight"], photos["crop"], photos["resolution"]) == (1, 2.0, None, 64)
    assert document["weighted"] is True
    assert {by_id[i]["dataset"] for i in style["buckets"]} == {"style"}
    assert set(style["buckets"]).isdisjoint(photos["buckets"])
    for row in rows:
        bucket = by_id[row["bucket"]]
        assert (bucket["dataset"], bucket["width"], bucket["height"]) == (
            row["dataset"], row["bucket_width"], row["bucket_height"]
        )  # fmt: skip
    assert all(by_id[i]["repeats"] >= 10 for i in style["buckets"])
    assert sum(b["count"] for b in document["buckets"]) == STYLE + PHOTOS

    again = _scan("--datasets", tmp_path / "list.toml", *common, "--allow-oversubscription")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["reused"] == STYLE + PHOTOS
    assert pq.read_table(out / "metadata.parquet").equals(table)


def test_a_short_bucket_names_its_dataset(sources: Path, tmp_path: Path) -> None:
    listed = _list(tmp_path / "list.toml", f'name = "style"\nsource = "{sources / "style"}"')
    result = _scan("--datasets", listed, "--out", tmp_path / "out", "--batch-size", 4, "--missing-caption", "empty")
    assert result.exit_code == 5, result.output
    assert "in dataset 'style' with repeats 1" in result.stderr and "higher repeats" in result.stderr
    assert (tmp_path / "out" / "metadata.parquet").is_file()  # written before the check, as for one source


def test_print_config_prints_the_list_it_read(sources: Path, tmp_path: Path) -> None:
    listed = _two(sources, tmp_path / "list.toml")
    result = _scan("--datasets", listed, "--print-config")
    assert result.exit_code == 0, result.output
    printed = tmp_path / "printed.toml"
    printed.write_text(result.stdout)
    assert read_datasets(str(printed)).specs == read_datasets(str(listed)).specs


def test_the_config_files_dataset_tables_are_a_list(sources: Path, tmp_path: Path) -> None:
    config = tmp_path / "stk.toml"
    config.write_text(
        f'[scan]\nmissing-caption = "empty"\nalignment = 16\nresolution = 64\nrepeats = 3\n\n'
        f'[[dataset]]\nname = "a"\nsource = "{sources / "style"}"\n\n'
        f'[[dataset]]\nname = "b"\nsource = "{sources / "photos"}"\nrepeats = 2\n'
    )
    result = _scan("--config", config, "--out", tmp_path / "out", "--allow-oversubscription")
    assert result.exit_code == 0, result.output
    assert [d["name"] for d in json.loads(result.stdout)["datasets"]] == ["a", "b"]
    document = json.loads((tmp_path / "out" / "buckets.json").read_text())
    assert [d["repeats"] for d in document["datasets"]] == [3, 2]  # a dataset without its own takes --repeats


@pytest.mark.parametrize(
    ("table", "needles"),
    [
        ('name = "e"\nsource = "{root}/empty"', ("dataset 'e'", "holds no images")),
        ('name = "m"\nsource = "{root}/missing"', ("dataset 'm'", "no such directory")),
        ('name = "s"\nsource = "-"', ("dataset 's'", "stdin")),
        ('name = "w"\nsource = "{root}/style"\nweight = 0', ("weight must be above 0",)),
        ('name = "u"\nsource = "{root}/style"\ncolour = "red"', ("unknown field", "colour")),
    ],
)
def test_a_bad_dataset_is_one_line_and_exit_3_before_any_work(
    sources: Path, tmp_path: Path, table: str, needles: tuple[str, ...]
) -> None:
    good = f'name = "good"\nsource = "{sources / "photos"}"'
    listed = _list(tmp_path / "list.toml", good, table.format(root=sources))
    result = _scan("--datasets", listed, "--out", tmp_path / "out")
    line = _one_line(result, 3)
    assert all(needle in line for needle in needles), line
    assert not (tmp_path / "out" / "datasets").exists()  # the good dataset was not scanned either


def test_duplicate_names_and_a_file_in_no_format_are_refused(sources: Path, tmp_path: Path) -> None:
    twice = f'name = "x"\nsource = "{sources / "style"}"'
    result = _scan("--datasets", _list(tmp_path / "list.toml", twice, twice), "--out", tmp_path / "out")
    assert "'x'" in _one_line(result, 3)
    other = tmp_path / "other.toml"
    other.write_text('[model]\nname = "sdxl"\n')
    assert str(other) in _one_line(_scan("--datasets", other, "--out", tmp_path / "out"), 3)


def test_source_and_datasets_together_or_neither_are_refused(sources: Path, tmp_path: Path) -> None:
    listed = _two(sources, tmp_path / "list.toml")
    assert "not both" in _one_line(_scan(sources / "style", "--datasets", listed, "--out", tmp_path / "out"), 3)
    assert "--datasets FILE" in _one_line(_scan("--out", tmp_path / "out"), 3)
    assert "--datasets" in _one_line(_scan(sources / "style", "--print-config"), 3)


def test_an_out_that_is_a_file_is_one_line_exit_3(sources: Path, tmp_path: Path) -> None:
    """It was a FileExistsError traceback (exit 1)."""
    (tmp_path / "out").write_text("mine")
    assert "--out" in _one_line(_scan(sources / "style", "--out", tmp_path / "out"), 3)
    assert (tmp_path / "out").read_text() == "mine"


def test_an_out_another_scan_holds_is_one_line_exit_7_with_nothing_written(sources: Path, tmp_path: Path) -> None:
    """Two scans on one --out: one died on a state file the other had renamed, or the last to finish won silently."""
    out = tmp_path / "out"
    out.mkdir()
    (out / SCAN_LEASE).write_text(json.dumps(asdict(Holder("node7", 4242, "run-7", "1234", 0))))
    for args in ((sources / "style",), ("--datasets", _two(sources, tmp_path / "list.toml"))):
        line = _one_line(_scan(*args, "--out", out), 7)
        assert f"--out {out} is in use by another stk-scan run (host node7, pid 4242, Slurm job 1234" in line
    assert os.listdir(out) == [SCAN_LEASE]
