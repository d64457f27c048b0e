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
from stk.cluster.lease import Holder, lease_name
from stk.datagen import generate_dataset, make_image
from stk.datasets import read_datasets

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
            row["dataset"],
            row["bucket_width"],
            row["bucket_height"],
        )
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
        ('name = "n"\nsource = "{root}/style"\nweight = nan', ("dataset 2: weight = nan is not a finite number",)),
        ('name = "i"\nsource = "{root}/style"\nweight = inf', ("dataset 2: weight = inf is not a finite number",)),
        ('name = "r"\nsource = "{root}/style"\nresolution = 1e9', ("resolution 1e+09", "65536")),
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


# --- other trainers' configs, scanned: each key means what it means in that trainer ---------------------------------

# SimpleTuner's simpletuner/examples/multidatabackend-small-dreambooth-1024px.json as it ships, and the video example
# of its documentation/DATALOADER.md: nothing in either is an image dataset stk can scan.
SIMPLETUNER_HUGGINGFACE = """[
  {
    "id": "dreambooth-1024",
    "type": "huggingface",
    "dataset_name": "RareConcepts/Domokun",
    "crop": true, "crop_style": "random", "crop_aspect": "square",
    "minimum_image_size": 256,
    "maximum_image_size": 1024,
    "target_downsample_size": 1024,
    "resolution": 1024,
    "resolution_type": "pixel_area",
    "metadata_backend": "huggingface",
    "caption_strategy": "instanceprompt",
    "instance_prompt": "\U0001f7eb",
    "cache_dir_vae": "cache/vae/{model_family}/dreambooth-1024"
  },
  {
    "id": "alt-embed-cache",
    "dataset_type": "text_embeds",
    "default": true,
    "type": "local",
    "cache_dir": "cache/text/{model_family}"
  }
]"""
SIMPLETUNER_VIDEO = """[
  {
    "id": "disney-black-and-white",
    "type": "local",
    "dataset_type": "video",
    "crop": false,
    "resolution": 480,
    "resolution_type": "pixel_area",
    "instance_data_dir": "datasets/disney-black-and-white",
    "caption_strategy": "textfile",
    "video": {"num_frames": 125, "min_frames": 125}
  },
  {
    "id": "text-embeds",
    "type": "local",
    "dataset_type": "text_embeds",
    "default": true,
    "cache_dir": "cache/text/ltxvideo"
  }
]"""


def _image(folder: Path, name: str, width: int, height: int, **sidecars: str) -> None:
    """`name`.png, and a caption file `name`.EXT for each EXT=caption given."""
    folder.mkdir(parents=True, exist_ok=True)
    make_image(width, height, seed=width + height).save(folder / f"{name}.png")
    for extension, caption in sidecars.items():
        (folder / f"{name}.{extension}").write_text(caption, encoding="utf-8")


def _rows(out: Path) -> dict[str, tuple[Any, ...]]:
    """The scan table's rows by file name: dataset, caption, its source and the bucket's sides."""
    table = pq.read_table(out / "metadata.parquet").to_pylist()
    keys = ("dataset", "caption", "caption_source", "bucket_width", "bucket_height")
    return {Path(row["path"]).name: tuple(row[key] for key in keys) for row in table}


def test_kohyas_caption_extension_given_or_its_default(tmp_path: Path) -> None:
    _image(tmp_path / "chars", "cat", 64, 64, caption="a cat, from .caption", txt="not read")
    _image(tmp_path / "chars", "dog", 64, 64, txt="not read either")  # no .caption: kohya captions it ""
    _image(tmp_path / "style", "sky", 64, 64, txt="a sky, from .txt", caption="not read")
    config = tmp_path / "dataset_config.toml"
    config.write_text(
        f"[general]\nenable_bucket = true\nresolution = 64\n\n[[datasets]]\n\n"
        f"  [[datasets.subsets]]\n  image_dir = '{tmp_path / 'chars'}'\n\n"
        f"  [[datasets.subsets]]\n  image_dir = '{tmp_path / 'style'}'\n  caption_extension = '.txt'\n"
    )
    out = tmp_path / "out"
    result = _scan("--datasets", config, "--out", out, "--alignment", 16, "--batch-size", 1, "--gpus", 1)
    assert result.exit_code == 0, result.output
    assert _rows(out) == {
        "cat.png": ("chars", "a cat, from .caption", "sidecar", 64, 64),
        "dog.png": ("chars", "", "empty", 64, 64),
        "sky.png": ("style", "a sky, from .txt", "sidecar", 64, 64),
    }


def test_simpletuners_filename_captions_textfile_and_square_crops(tmp_path: Path) -> None:
    _image(tmp_path / "named", "a_red-car", 96, 64, txt="not read: captions come from the name")
    _image(tmp_path / "named", "tall_one", 64, 128)
    _image(tmp_path / "texts", "wide", 96, 64, txt="a wide one", caption="not read")
    _image(tmp_path / "texts", "lone", 64, 64, caption="not read: textfile reads .txt only")
    entries = [
        # no caption_strategy (SimpleTuner's default, filename), crop without crop_aspect (its default, square)
        {
            "id": "named",
            "type": "local",
            "instance_data_dir": str(tmp_path / "named"),
            "crop": True,
            "crop_style": "center",
            "resolution": 64,
            "resolution_type": "pixel",
            "repeats": 0,
        },
        {
            "id": "texts",
            "type": "local",
            "instance_data_dir": str(tmp_path / "texts"),
            "caption_strategy": "textfile",
            "resolution": 64,
            "resolution_type": "pixel",
        },
        {"id": "text-embeds", "dataset_type": "text_embeds", "default": True, "type": "local", "cache_dir": "cache"},
    ]
    config = tmp_path / "multidatabackend.json"
    config.write_text(json.dumps(entries))
    out = tmp_path / "out"
    common = ["--alignment", 16, "--batch-size", 1, "--gpus", 1, "--max-errors", 1]
    result = _scan("--datasets", config, "--out", out, *common)
    assert result.exit_code == 0, result.output
    assert _rows(out) == {
        "a_red-car.png": ("named", "a red-car", "filename", 64, 64),  # the stem, '_' as a space
        "tall_one.png": ("named", "tall one", "filename", 64, 64),  # square, whatever its aspect
        "wide.png": ("texts", "a wide one", "sidecar", 96, 64),  # aspect buckets
    }
    (error,) = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert (Path(error["path"]).name, error["kind"]) == ("lone.png", "caption_missing")
    named, texts = json.loads((out / "buckets.json").read_text())["datasets"]
    assert (named["aspect"], named["crop"], texts["aspect"], texts["crop"]) == ("square", "center", "buckets", None)


@pytest.mark.parametrize("text", [SIMPLETUNER_HUGGINGFACE, SIMPLETUNER_VIDEO], ids=["huggingface", "video"])
def test_a_list_with_nothing_stk_can_scan_says_why_each_entry_was_skipped(tmp_path: Path, text: str) -> None:
    config = tmp_path / "multidatabackend.json"
    config.write_text(text, encoding="utf-8")
    result = _scan("--datasets", config, "--out", tmp_path / "out")
    error = _one_line(result, 3)
    assert "no datasets stk can scan" in error
    lines = result.stderr.splitlines()
    skipped = [line for line in lines if "WARNING" in line and line.endswith("; skipped")]
    assert [line.split("dataset '")[1].split("'")[0] for line in skipped] == [e["id"] for e in json.loads(text)]
    assert lines.index(skipped[-1]) < lines.index(error)  # the reasons, then the error


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
