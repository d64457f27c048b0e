"""Reading a dataset list: the format told from the content, stk's own [[dataset]] tables, and one line with
exit 3 for a file that is in no format stk reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.dataset_files import refusal

from stk.datasets import DatasetSpec, datasets_in_config, read_datasets
from stk.datasets.formats import ACCEPTED
from stk.errors import InputError

STK = """
[scan]
batch-size = 4

[[dataset]]
name = "style"
source = "/data/style"
repeats = 10
resolution = 512

[[dataset]]
name = "photos"
source = "s3://bucket/photos"
weight = 2
"""


def write(tmp_path: Path, name: str, text: str | bytes) -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def test_stks_own_tables_are_read_beside_the_commands_tables(tmp_path: Path) -> None:
    found = read_datasets(write(tmp_path, "run.toml", STK))
    assert found.format == "stk" and found.warnings == []
    assert found.specs == [
        DatasetSpec(name="style", source="/data/style", repeats=10, resolution=512.0),
        DatasetSpec(name="photos", source="s3://bucket/photos", weight=2.0),
    ]


def test_the_format_comes_from_the_content_not_the_name(tmp_path: Path) -> None:
    kohya_json = {"datasets": [{"enable_bucket": True, "subsets": [{"image_dir": "/data/a"}]}]}
    assert read_datasets(write(tmp_path, "config.toml", json.dumps(kohya_json))).format == "kohya"
    simpletuner = [{"id": "a", "type": "local", "instance_data_dir": "/data/a"}]
    assert read_datasets(write(tmp_path, "datasets.txt", json.dumps(simpletuner))).format == "simpletuner"
    assert read_datasets(write(tmp_path, "list.json", STK)).format == "stk"  # TOML in a .json file


def test_datasets_in_config_takes_the_list_from_a_config_file(tmp_path: Path) -> None:
    assert datasets_in_config(write(tmp_path, "run.toml", STK)) == read_datasets(str(tmp_path / "run.toml")).specs
    assert datasets_in_config(write(tmp_path, "plain.toml", "[scan]\nbatch-size = 4\n")) is None
    with pytest.raises(InputError, match=r"^--config .*dup\.toml: two datasets are named 'a'"):
        table = "[[dataset]]\nname = 'a'\nsource = '/d'\n"
        datasets_in_config(write(tmp_path, "dup.toml", table * 2))
    with pytest.raises(InputError, match=r"^--config .*bad\.toml: not valid TOML"):
        datasets_in_config(write(tmp_path, "bad.toml", "[[dataset]\n"))


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("run.toml", "[scan]\nbatch-size = 4\n", f"no dataset list found; {ACCEPTED}"),
        ("list.json", '{"id": "a"}', f"no dataset list found; {ACCEPTED}"),
        ("both.toml", "[[dataset]]\nname='a'\n[[datasets]]\n", f"no dataset list found; {ACCEPTED}"),
        ("list.json", '[{"id": "a",}]', "not valid JSON (Expecting property name"),
        ("list.toml", "[[dataset]\nname = 'a'\n", "not valid TOML (Expected ']]'"),
        ("notes.txt", "just some words\n", "not valid TOML (Expected '=' after a key"),
        ("latin1.toml", b"name = '\xe9'\n", f"not UTF-8 text (invalid continuation byte); {ACCEPTED}"),
        ("one.toml", "[dataset]\nname = 'a'\nsource = '/d'\n", "dataset must be an array of tables: write each"),
        ("x.toml", "[[dataset]]\nname = 'a'\nsource = '/d'\nrepeat = 2\n", "dataset 1: unknown field(s) repeat"),
        ("x.toml", "[[dataset]]\nname = 'a'\nsource = '/d'\nweight = 0\n", "weight must be above 0, not 0"),
        ("x.toml", "[[dataset]]\nname = 'a'\nsource = '/d'\nweight = -1.5\n", "weight must be above 0, not -1.5"),
        ("x.toml", "[[dataset]]\nname = 'a'\nsource = '/d'\nweight = nan\n", "dataset 1: weight = nan is not a finite"),
        ("x.toml", "[[dataset]]\nname = 'a'\nsource = '/d'\nresolution = -inf\n", "resolution = -inf is not a finite"),
        (
            "list.json",
            '[{"id": "a", "instance_data_dir": "/d", "probability": Infinity}]',
            "inf is not a finite number",
        ),
        ("x.toml", "[[dataset]]\nname = 'a'\nsource = '/d'\n" * 2, "two datasets are named 'a'"),
        ("x.toml", "dataset = []\n", "no datasets"),
        ("x.toml", "[[dataset]]\nname='a'\nsource='/d'\ncaption-extension='txt'\n", "'txt' must be '.' and a name"),
        ("x.toml", "[[dataset]]\nname='a'\nsource='/d'\ncaption-extension='.png'\n", "'.png' is an image's"),
        ("x.toml", "[[dataset]]\nname='a'\nsource='/d'\naspect='round'\n", "expected one of buckets, square"),
        (
            "x.toml",
            "[[dataset]]\nname='a'\nsource='/d'\ncaptions='stem'\nmissing-caption='empty'\n",
            'missing-caption does not apply with captions = "stem"',
        ),
    ],
)
def test_bad_files_are_refused_in_one_line_naming_the_file(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = write(tmp_path, name, text)
    refused = refusal(path)
    assert message in refused
    if message.startswith(("not ", "no dataset list")):  # the file as a whole: what stk reads is named
        assert refused.endswith(ACCEPTED)


@pytest.mark.parametrize("name", ["missing.toml", "."])
def test_a_file_that_cannot_be_read_is_refused(tmp_path: Path, name: str) -> None:
    path = str(tmp_path / name)
    with pytest.raises(InputError, match=r": cannot be read \(.+\); expected stk's TOML"):
        read_datasets(path)


def test_the_example_list_in_the_repository_reads_without_warnings() -> None:
    example = Path(__file__).resolve().parents[3] / "etc" / "datasets.toml"
    found = read_datasets(str(example))
    assert (found.format, found.warnings) == ("stk", [])
    assert [(spec.name, spec.repeats) for spec in found.specs] == [("style", 10), ("photos", None)]
