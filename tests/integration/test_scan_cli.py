"""stk-scan as a user runs it: every kind of bad input, the documented exit codes, every kind of
source (tree, stdin list, parquet and JSONL tables), incremental reruns and --help."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import PIL
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.bad_inputs import without_dac_override
from support.commands import RunScan, scan_command, scan_env, summary_of

from stk.datagen import generate_dataset, make_image
from stk.imageinfo import is_image_name
from stk.scan.records import JSONL_COLUMNS

pytestmark = pytest.mark.integration

IS_ROOT = os.geteuid() == 0


def _rows(out: Path) -> list[dict[str, Any]]:
    return pq.read_table(out / "metadata.parquet").to_pylist()


def _errors(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]


def _buckets(out: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / "buckets.json").read_text())
    return doc


def _no_traceback(proc: Any) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "unexpected error" not in proc.stderr, proc.stderr


def _save_png(path: Path, width: int, height: int, seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    make_image(width, height, seed=seed).save(path, "PNG")


GOOD = [f"good/g{i}.png" for i in range(6)]


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """Six good images (80x64, each with a caption) and one file of every bad kind that a tree
    scan with --max-pixels 20000 --missing-caption error finds; returns (root, {path: kind})."""
    root = tmp_path / "corpus"
    for i, rel in enumerate(GOOD):
        _save_png(root / rel, 80, 64, seed=i)
        (root / rel).with_suffix(".txt").write_text(f"good image {i}\n")
    bad = root / "bad"
    bad.mkdir()
    expected = {}

    (bad / "empty.jpg").write_bytes(b"")
    expected["bad/empty.jpg"] = "empty"

    buffer = io.BytesIO()
    make_image(128, 128, seed=3).save(buffer, "JPEG", quality=90)  # 16,384 pixels: under --max-pixels
    whole = buffer.getvalue()
    (bad / "half.jpg").write_bytes(whole[: len(whole) // 2])
    expected["bad/half.jpg"] = "truncated"

    (bad / "notes.png").write_text("this is a text file with an image extension\n" * 5)
    expected["bad/notes.png"] = "not_image"

    make_image(32, 32).save(bad / "icon.jpg", "ICO")  # Pillow reads ICO; stk does not train on it
    expected["bad/icon.jpg"] = "unsupported_format"

    _save_png(bad / "huge.png", 300, 300)  # 90,000 pixels > --max-pixels 20000
    (bad / "huge.txt").write_text("huge\n")
    expected["bad/huge.png"] = "too_many_pixels"

    os.symlink("does-not-exist.png", bad / "dangling.png")
    expected["bad/dangling.png"] = "broken_symlink"

    _save_png(bad / "latin1.png", 80, 64)
    (bad / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    expected["bad/latin1.png"] = "caption_unreadable"

    _save_png(bad / "uncaptioned.png", 80, 64)
    expected["bad/uncaptioned.png"] = "caption_missing"

    if not IS_ROOT:  # root reads a mode-000 file anyway
        _save_png(bad / "locked.png", 80, 64)
        (bad / "locked.txt").write_text("locked\n")
        (bad / "locked.png").chmod(0)
        expected["bad/locked.png"] = "unreadable"
    return root, expected


BAD_ARGS = ["--max-pixels", "20000", "--missing-caption", "error", "--gpus", "1"]


# --- bad inputs -----------------------------------------------------------------------


def test_every_bad_file_in_a_tree_is_an_error_row(
    corpus: tuple[Path, dict[str, str]], run_scan: RunScan, tmp_path: Path
):
    root, expected = corpus
    out = tmp_path / "out"
    proc = run_scan([root, "--out", out, *BAD_ARGS, "--max-errors", "1000"])
    assert proc.returncode == 0, proc.stderr
    _no_traceback(proc)

    errors = _errors(out)
    assert {e["path"]: e["kind"] for e in errors} == expected
    for e in errors:
        assert isinstance(e["reason"], str) and len(e["reason"]) > 5, e
    summary = summary_of(proc)
    kinds: dict[str, int] = {}
    for kind in expected.values():
        kinds[kind] = kinds.get(kind, 0) + 1
    assert summary["error_kinds"] == kinds
    assert summary["errors"] == len(expected)
    assert summary["files"] == len(expected) + len(GOOD)
    assert summary["images"] == len(GOOD)
    assert [r["path"] for r in _rows(out)] == GOOD
    assert all(r["caption_source"] == "sidecar" and r["caption"].startswith("good image") for r in _rows(out))
    assert json.loads((out / "summary.json").read_text())["error_kinds"] == kinds


def test_table_paths_escaping_the_root_are_errors(tmp_path: Path, run_scan: RunScan):
    root = tmp_path / "data"
    _save_png(root / "ok.png", 80, 64)
    _save_png(tmp_path / "outside.png", 80, 64)  # exists, but is outside the root
    table = root / "meta.jsonl"
    rows = [
        {"file_name": "ok.png", "text": "fine"},
        {"file_name": "../outside.png", "text": "sneaky"},
        {"file_name": "/etc/passwd", "text": "worse"},
        {"file_name": "sub/../../elsewhere.png", "text": "hidden climb"},
    ]
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    proc = run_scan([table, "--out", out, "--max-errors", "10"])
    assert proc.returncode == 0, proc.stderr
    errors = {e["path"]: e for e in _errors(out)}
    assert {p: e["kind"] for p, e in errors.items()} == {
        "../outside.png": "path_escapes_root",
        "/etc/passwd": "path_escapes_root",
        "sub/../../elsewhere.png": "path_escapes_root",  # reported as written in the table
    }
    assert all("escapes the root" in e["reason"] for e in errors.values())
    assert [(r["path"], r["caption"]) for r in _rows(out)] == [("ok.png", "fine")]
    assert summary_of(proc)["error_kinds"] == {"path_escapes_root": 3}


def test_stdin_entries_that_cannot_be_read(tmp_path: Path, run_scan: RunScan):
    root = tmp_path / "data"
    _save_png(root / "a.png", 80, 64)
    (root / "a.txt").write_text("caption of a\n")
    (root / "x.jpg").mkdir()  # a directory with an image name
    listing = [str(root / "a.png"), str(root / "x.jpg"), str(root / "gone.png"), str(root / "a.png")]
    expected = {str(root / "x.jpg"): "not_a_file", str(root / "gone.png"): "not_found"}
    if not IS_ROOT:
        _save_png(root / "locked.png", 80, 64)
        (root / "locked.png").chmod(0)
        listing.append(str(root / "locked.png"))
        expected[str(root / "locked.png")] = "unreadable"
    out = tmp_path / "out"
    proc = run_scan(["-", "--out", out, "--max-errors", "100"], stdin="\n".join(listing) + "\n")
    assert proc.returncode == 0, proc.stderr
    errors = _errors(out)
    by_kind = {(e["path"], e["kind"]) for e in errors}
    assert set(expected.items()) <= by_kind
    assert (str(root / "a.png"), "duplicate") in by_kind  # listed twice: one row, one error
    assert [(r["path"], r["caption"]) for r in _rows(out)] == [(str(root / "a.png"), "caption of a")]
    assert summary_of(proc)["errors"] == len(expected) + 1


@pytest.fixture
def odd_entries(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """400 good images beside what once hung or crashed a scan: a FIFO and a socket with image names, a FIFO as
    a caption sidecar, a subdirectory that cannot be listed, and an image (with its caption) whose name is not
    UTF-8. Four error rows: under the default --max-errors (1%) of 405 files. Returns (root, {path: kind})."""
    root = tmp_path / "odd"
    _save_png(root / "good" / "g000.png", 80, 64)
    for i in range(1, 400):
        os.link(root / "good" / "g000.png", root / "good" / f"g{i:03d}.png")
    os.mkfifo(root / "x.jpg")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(root / "sock.png"))
    server.close()  # the socket file stays
    _save_png(root / "piped.png", 80, 64)
    os.mkfifo(root / "piped.txt")
    _save_png(root / "locked" / "inside.png", 80, 64)
    (root / "locked").chmod(0)
    name = os.fsencode(root) + b"/\xff\xfe.png"
    make_image(80, 64).save(name, "PNG")
    with open(name[:-4] + b".txt", "wb") as f:
        f.write(b"a caption\n")
    kinds = {"x.jpg": "not_a_file", "sock.png": "not_a_file", "piped.png": "not_a_file", "locked/": "unreadable"}
    return root, kinds


@pytest.mark.timeout(60)
def test_fifos_sockets_unlistable_directories_and_names_not_utf8_are_one_row_each(
    odd_entries: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    root, kinds = odd_entries
    out = tmp_path / "out"
    # as root, drop the capabilities that read any directory: `locked` cannot be listed then
    command = [*without_dac_override(), *scan_command([root, "--out", out])]
    for attempt in ("first", "rerun"):  # the rerun reuses the state, the escaped name included
        proc = subprocess.run(command, capture_output=True, text=True, env=scan_env(), timeout=40)
        assert proc.returncode == 0, (attempt, proc.stderr)
        _no_traceback(proc)
        errors = {e["path"]: e for e in _errors(out)}
        assert {path: e["kind"] for path, e in errors.items()} == kinds
        assert "is a FIFO" in errors["x.jpg"]["reason"] and "is a socket" in errors["sock.png"]["reason"]
        assert "caption" in errors["piped.png"]["reason"] and "piped.txt: is a FIFO" in errors["piped.png"]["reason"]
        assert "cannot list directory" in errors["locked/"]["reason"]
        rows = {r["path"]: r for r in _rows(out)}
        assert len(rows) == 401 and "good/g399.png" in rows
        odd = rows["\\xff\\xfe.png"]  # the undecodable bytes as \xNN in the table's UTF-8
        assert (odd["width"], odd["height"], odd["caption"], odd["caption_source"]) == (80, 64, "a caption", "sidecar")
        assert summary_of(proc)["errors"] == 4
    (root / "locked").chmod(0o755)

    # the same name and a FIFO from a list on stdin
    listing = os.fsencode(root) + b"/\xff\xfe.png\n" + os.fsencode(root / "x.jpg") + b"\n"
    listed = subprocess.run(
        scan_command(["-", "--out", tmp_path / "listed", "--max-errors", "1"]),
        input=listing, capture_output=True, env=scan_env(), timeout=40,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr.decode(errors="replace")
    assert [r["path"] for r in _rows(tmp_path / "listed")] == [f"{root}/\\xff\\xfe.png"]
    assert [(e["path"], e["kind"]) for e in _errors(tmp_path / "listed")] == [(str(root / "x.jpg"), "not_a_file")]


TEST_DATA = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stk-test-data"


def _fetch_pillow_sdist(version: str) -> Path:
    """The sdist of Pillow `version` in TEST_DATA, through pip; skipped where that fails (failed under CI)."""
    sdist = TEST_DATA / f"pillow-{version}.tar.gz"
    if sdist.exists():
        return sdist
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"pillow=={version}"]
    proc = subprocess.run([*command, "-d", str(TEST_DATA)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not sdist.exists():
        message = f"cannot fetch Pillow {version}'s sdist from PyPI: {(proc.stderr or proc.stdout).strip()[-300:]}"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI is set, so this must not be skipped")
        pytest.skip(message)
    return sdist


@pytest.fixture(scope="module")
def pillow_images() -> Path:
    """Pillow's own test images (`Tests/images` of the installed version's sdist: every format, many broken on
    purpose), fetched once into ~/.cache/stk-test-data; the wheel has none."""
    version = PIL.__version__
    images = TEST_DATA / f"pillow-{version}" / "Tests" / "images"
    if not images.is_dir():
        TEST_DATA.mkdir(parents=True, exist_ok=True)
        sdist = _fetch_pillow_sdist(version)
        prefix = f"pillow-{version}/Tests/images/"
        with tempfile.TemporaryDirectory(dir=TEST_DATA) as staging, tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            assert members, f"{sdist} holds no {prefix}"
            tar.extractall(staging, members=members, filter="data")
            with contextlib.suppress(OSError):  # another test run put it there first
                os.rename(Path(staging) / f"pillow-{version}", TEST_DATA / f"pillow-{version}")
        sdist.unlink(missing_ok=True)
    return images


@pytest.mark.timeout(600)  # the first run on a machine downloads the sdist (47 MB, ~30 s); then ~5 s
def test_every_file_of_pillows_own_test_images_is_a_row(pillow_images: Path, run_scan: RunScan, tmp_path: Path):
    files = sorted(str(p) for p in pillow_images.rglob("*") if p.is_file())
    assert len(files) > 500
    # A third of these files are broken on purpose (fuzzer crashes, truncations): none may end the scan, so any
    # number of errors is allowed.
    listed = tmp_path / "listed"  # every file, whatever its extension
    proc = run_scan(["-", "--out", listed, "--max-errors", "100%"], stdin="\n".join(files) + "\n")
    assert proc.returncode == 0, proc.stderr
    _no_traceback(proc)
    rows, errors = _rows(listed), _errors(listed)
    assert {r["path"] for r in rows} | {e["path"] for e in errors} == set(files)
    assert len(rows) > 300, "most of Pillow's images are readable"
    for e in errors:
        if e["kind"] == "decoder_error":  # what a plugin raised, named with its type (Pillow 13's DDS plugin:
            assert re.match(r"the image decoder failed: [A-Za-z]\w*(: |$)", e["reason"]), e  # NotImplementedError)

    tree = tmp_path / "tree"  # as users scan it: every file with an image extension
    proc = run_scan([pillow_images, "--out", tree, "--max-errors", "100%"])
    assert proc.returncode == 0, proc.stderr
    _no_traceback(proc)
    named = {os.path.relpath(f, pillow_images) for f in files if is_image_name(f)}
    assert {r["path"] for r in _rows(tree)} | {e["path"] for e in _errors(tree)} == named


# --- exit codes -----------------------------------------------------------------------


def test_too_many_errors_exits_4_with_outputs_written(
    corpus: tuple[Path, dict[str, str]], run_scan: RunScan, tmp_path: Path
):
    root, expected = corpus
    faults = len(expected)
    out = tmp_path / "out"
    proc = run_scan([root, "--out", out, *BAD_ARGS])  # default --max-errors 1%
    assert proc.returncode == 4, proc.stderr
    _no_traceback(proc)
    assert "--max-errors" in proc.stderr and "errors.jsonl" in proc.stderr
    assert len(_errors(out)) == faults
    assert [r["path"] for r in _rows(out)] == GOOD
    assert _buckets(out)["buckets"]
    assert json.loads((out / "summary.json").read_text())["errors"] == faults

    # the limit is inclusive: exactly as many faults as allowed passes, one fewer fails
    at_limit = run_scan([root, "--out", tmp_path / "at", *BAD_ARGS, "--max-errors", str(faults)])
    assert at_limit.returncode == 0, at_limit.stderr
    below = run_scan([root, "--out", tmp_path / "below", *BAD_ARGS, "--max-errors", str(faults - 1)])
    assert below.returncode == 4, below.stderr
    percent = run_scan([root, "--out", tmp_path / "pct", *BAD_ARGS, "--max-errors", "90%"])
    assert percent.returncode == 0, percent.stderr


def test_batch_check_failure_exits_5_and_lists_short_buckets(
    dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path
):
    root, _ = dataset
    out = tmp_path / "out"
    proc = run_scan([root, "--out", out, "--batch-size", "4", "--gpus", "1"])
    assert proc.returncode == 5, proc.stderr
    _no_traceback(proc)
    doc = _buckets(out)
    short = doc["short_buckets"]
    assert short and doc["batch_check_ok"] is False and doc["oversubscribed"] is False
    needs = [line for line in proc.stderr.splitlines() if "needs --repeats >=" in line]
    assert len(needs) == len(short)
    for s in short:
        bucket = next(b for b in doc["buckets"] if b["id"] == s["id"])
        line = f"bucket {s['id']} ({bucket['width']}x{bucket['height']}): {s['count']} images"
        assert any(line in n and f"--repeats >= {s['min_repeats']}" in n for n in needs), (line, needs)
    assert "--allow-oversubscription" in proc.stderr
    assert (out / "metadata.parquet").exists() and (out / "errors.jsonl").exists()
    assert json.loads((out / "summary.json").read_text())["short_buckets"] == len(short)


def test_allow_oversubscription_records_raised_repeats(dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path):
    root, _ = dataset
    out = tmp_path / "out"
    proc = run_scan([root, "--out", out, "--batch-size", "4", "--gpus", "1", "--allow-oversubscription"])
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    doc = _buckets(out)
    assert doc["oversubscribed"] is True and doc["batch_check_ok"] is True
    short = {s["id"]: s["min_repeats"] for s in doc["short_buckets"]}
    assert len(short) == summary["short_buckets"] > 0
    for bucket in doc["buckets"]:
        if bucket["id"] in short:
            assert bucket["repeats"] == short[bucket["id"]] > 1
            assert bucket["count"] * bucket["repeats"] >= 4
        else:
            assert bucket["repeats"] == 1


def test_missing_source_exits_3_with_one_line(tmp_path: Path, run_scan: RunScan):
    missing = tmp_path / "no-such-dir"
    proc = run_scan([missing, "--out", tmp_path / "out"])
    assert proc.returncode == 3
    _no_traceback(proc)
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and str(missing) in errors[0] and "no such directory" in errors[0]
    assert proc.stdout == ""
    assert not (tmp_path / "out" / "metadata.parquet").exists()

    table = run_scan([tmp_path / "nothing.parquet", "--out", tmp_path / "out"])
    assert table.returncode == 3 and "no such table" in table.stderr
    _no_traceback(table)


def test_bad_option_exits_2(tmp_path: Path, run_scan: RunScan):
    proc = run_scan([tmp_path, "--out", tmp_path / "out", "--threads", "0"])
    assert proc.returncode == 2
    assert "--threads" in proc.stderr
    bad_column = run_scan([tmp_path, "--out", tmp_path / "out", "--column", "pth=x"])
    assert bad_column.returncode == 2


def test_help_mentions_environment_variables(run_scan: RunScan):
    proc = run_scan(["--help"])
    assert proc.returncode == 0
    for name in ("STK_SCAN_OUT", "STK_SCAN_COLUMN", "STK_SCAN_MAX_ERRORS", "STK_SCAN_S3_ENDPOINT_URL"):
        assert re.search(rf"\b{name}\b", proc.stdout), name
    assert "Exit codes" in proc.stdout


def test_environment_variable_sets_an_option(dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path):
    root, _ = dataset
    out = tmp_path / "from-env"
    proc = run_scan([root, "--out", out, "--gpus", "1"], env={"STK_SCAN_BATCH_SIZE": "4"})
    assert proc.returncode == 5, proc.stderr  # the batch size came from the environment
    assert _buckets(out)["batch_size"] == 4
    # the command line wins over the environment
    proc = run_scan([root, "--out", out, "--gpus", "1", "--batch-size", "1"], env={"STK_SCAN_BATCH_SIZE": "4"})
    assert proc.returncode == 0, proc.stderr
    assert _buckets(out)["batch_size"] == 1


# --- sources and output formats -------------------------------------------------------


def test_jsonl_rows_on_stdout(dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path):
    root, made = dataset
    out = tmp_path / "out"
    proc = run_scan([root, "--out", out, "--jsonl", "--gpus", "1"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    parsed = [json.loads(line) for line in lines]
    table = _rows(out)
    assert len(parsed) == len(table) > 0
    for row, ref in zip(parsed, table, strict=True):
        assert set(row) == set(JSONL_COLUMNS)
        assert {k: row[k] for k in ("path", "width", "height", "caption", "bucket")} == {
            k: ref[k] for k in ("path", "width", "height", "caption", "bucket")
        }
    truth = {m.path: (m.width, m.height) for m in made}
    assert all((row["width"], row["height"]) == truth[row["path"]] for row in parsed)


def test_stdin_list_of_paths(dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path):
    root, made = dataset
    chosen = made[:10]
    text = "# picked by hand\n\n" + "".join(f"{root / m.path}\n" for m in chosen)
    out = tmp_path / "out"
    proc = run_scan(["-", "--out", out, "--gpus", "1", "--min-aspect", "0.2", "--max-aspect", "5"], stdin=text)
    assert proc.returncode == 0, proc.stderr
    rows = {r["path"]: r for r in _rows(out)}
    assert set(rows) == {str(root / m.path) for m in chosen}
    for m in chosen:
        row = rows[str(root / m.path)]
        assert (row["width"], row["height"]) == (m.width, m.height)
        if m.caption is not None:  # sidecars are found next to listed files
            assert (row["caption"], row["caption_source"]) == (m.caption, "sidecar")
        else:
            assert row["caption_source"] == "filename"
    assert summary_of(proc)["files"] == 10


def test_parquet_table_from_another_trainer(tmp_path: Path, run_scan: RunScan):
    root = tmp_path / "data"
    _save_png(root / "img/a.png", 80, 64)
    _save_png(root / "img/b.png", 96, 64)
    _save_png(root / "img/c.png", 64, 96)
    (root / "img/c.txt").write_text("sidecar for c\n")
    (root / "img/fake.png").write_bytes(b"not an image, but the table knows its size")
    table = pa.table(
        {
            "filename": ["img/a.png", "img/b.png", "img/c.png", "img/fake.png"],
            "caption": ["caption a", "caption b", None, "caption fake"],
            "width": [200, None, None, 120],
            "height": [100, None, None, 100],
        }
    )
    pq.write_table(table, root / "metadata.parquet")
    out = tmp_path / "out"
    proc = run_scan([root / "metadata.parquet", "--out", out, "--gpus", "1"])
    assert proc.returncode == 0, proc.stderr
    rows = {r["path"]: r for r in _rows(out)}
    assert set(rows) == {"img/a.png", "img/b.png", "img/c.png", "img/fake.png"}
    # rows with a size are not probed: the table's values are kept, even for a non-image
    assert (rows["img/a.png"]["width"], rows["img/a.png"]["height"]) == (200, 100)
    assert (rows["img/fake.png"]["width"], rows["img/fake.png"]["height"]) == (120, 100)
    assert rows["img/a.png"]["format"] is None
    # rows without a size are probed
    assert (rows["img/b.png"]["width"], rows["img/b.png"]["height"], rows["img/b.png"]["format"]) == (96, 64, "PNG")
    assert (rows["img/c.png"]["width"], rows["img/c.png"]["height"]) == (64, 96)
    assert [rows[p]["caption"] for p in ("img/a.png", "img/b.png", "img/c.png")] == [
        "caption a",
        "caption b",
        "sidecar for c",
    ]
    assert rows["img/a.png"]["caption_source"] == "table" and rows["img/c.png"]["caption_source"] == "sidecar"
    assert summary_of(proc)["errors"] == 0

    # --root: the same table kept elsewhere
    elsewhere = tmp_path / "tables" / "meta.parquet"
    elsewhere.parent.mkdir()
    pq.write_table(table, elsewhere)
    proc = run_scan([elsewhere, "--root", root, "--out", tmp_path / "out2", "--gpus", "1"])
    assert proc.returncode == 0, proc.stderr
    assert _rows(tmp_path / "out2") == _rows(out)


def test_jsonl_table_with_column_mapping(tmp_path: Path, run_scan: RunScan):
    root = tmp_path / "data"
    _save_png(root / "one.png", 80, 64)
    _save_png(root / "two.png", 64, 80)
    lines = [
        {"path": "stale/one.png", "file_name": "one.png", "text": "first"},
        {"path": "stale/two.png", "file_name": "two.png", "text": "second"},
    ]
    table = root / "metadata.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in lines))

    mapped = run_scan([table, "--out", tmp_path / "mapped", "--column", "path=file_name", "--gpus", "1"])
    assert mapped.returncode == 0, mapped.stderr
    rows = _rows(tmp_path / "mapped")
    assert [(r["path"], r["width"], r["height"], r["caption"]) for r in rows] == [
        ("one.png", 80, 64, "first"),
        ("two.png", 64, 80, "second"),
    ]
    # without the mapping, the 'path' column wins and names files that do not exist
    unmapped = run_scan([table, "--out", tmp_path / "unmapped", "--gpus", "1", "--max-errors", "10"])
    assert unmapped.returncode == 0, unmapped.stderr
    assert {e["kind"] for e in _errors(tmp_path / "unmapped")} == {"not_found"}
    missing = run_scan([table, "--out", tmp_path / "bad", "--column", "path=nope"])
    assert missing.returncode == 3 and "nope" in missing.stderr
    _no_traceback(missing)


# --- incremental reruns ---------------------------------------------------------------


def test_incremental_local_rerun_and_full(tmp_path: Path, run_scan: RunScan):
    root = tmp_path / "data"
    made = generate_dataset(str(root), count=20, seed=11, min_side=64, max_side=120)  # nothing filtered
    out = tmp_path / "out"
    args = [root, "--out", out, "--gpus", "1"]
    first = summary_of(run_scan(args))
    assert (first["files"], first["scanned"], first["reused"], first["images"]) == (20, 20, 0, 20)
    second = summary_of(run_scan(args))
    assert (second["scanned"], second["reused"]) == (0, 20)
    before = {r["path"]: r for r in _rows(out)}

    touched, removed = made[2].path, made[5].path
    st = os.stat(root / touched)
    os.utime(root / touched, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    os.remove(root / removed)
    _save_png(root / "landscapes/new_one.png", 100, 80)

    proc = run_scan(args)
    assert proc.returncode == 0, proc.stderr
    third = summary_of(proc)
    assert (third["files"], third["scanned"], third["reused"]) == (20, 2, 18)
    after = {r["path"]: r for r in _rows(out)}
    assert removed not in after
    assert (after["landscapes/new_one.png"]["width"], after["landscapes/new_one.png"]["height"]) == (100, 80)
    assert after[touched]["mtime"] == pytest.approx(before[touched]["mtime"] + 5)
    assert after[touched]["fingerprint"] != before[touched]["fingerprint"]
    for path in set(after) - {touched, "landscapes/new_one.png"}:
        assert after[path] == before[path]

    # a changed caption sidecar rescans its image only
    captioned = next(m for m in made if m.caption is not None and m.path not in (touched, removed))
    stem = (root / captioned.path).with_suffix("")
    sidecar = next(p for p in (stem.with_suffix(".txt"), stem.with_suffix(".caption")) if p.exists())
    sidecar.write_text("a brand new caption\n")
    os.utime(sidecar, ns=(st.st_atime_ns, st.st_mtime_ns + 9_000_000_000))
    fourth = summary_of(run_scan(args))
    assert (fourth["scanned"], fourth["reused"]) == (1, 19)
    assert {r["path"]: r for r in _rows(out)}[captioned.path]["caption"] == "a brand new caption"

    full = summary_of(run_scan([*args, "--full"]))
    assert (full["files"], full["scanned"], full["reused"]) == (20, 20, 0)
    assert {r["path"]: r["width"] for r in _rows(out)} == {p: r["width"] for p, r in after.items()}


def test_rerun_reuses_bad_and_filtered_files_unless_the_settings_change(
    corpus: tuple[Path, dict[str, str]], run_scan: RunScan, tmp_path: Path
):
    root, expected = corpus
    _save_png(root / "small.png", 20, 16)  # filtered by --min-size below
    (root / "small.txt").write_text("small\n")
    out = tmp_path / "out"
    args = [root, "--out", out, *BAD_ARGS, "--max-errors", "1000", "--min-size", "32"]
    first = summary_of(run_scan(args))
    assert first["skipped"] == 1 and first["errors"] == len(expected)

    again = summary_of(run_scan(args))
    # only the broken symlink is looked at again: it is caught while listing, not reused
    assert again["scanned"] == 1 and again["reused"] == first["files"] - 1
    assert again["error_kinds"] == first["error_kinds"] and again["skipped"] == 1
    assert (out / "errors.jsonl").read_text() == _errors_text(run_scan, args, tmp_path)

    # another --max-pixels could change every result: nothing is reused
    looser = summary_of(run_scan([*args, "--max-pixels", "1000000"]))
    assert looser["reused"] == 0 and looser["scanned"] == first["files"]
    assert "too_many_pixels" not in looser["error_kinds"]


def _errors_text(run_scan: RunScan, args: list[Any], tmp_path: Path) -> str:
    """errors.jsonl of a clean scan with the same arguments, in a fresh directory."""
    fresh = tmp_path / "fresh"
    run_scan([args[0], "--out", fresh, *args[3:]])
    return (fresh / "errors.jsonl").read_text()


def test_a_damaged_state_file_costs_a_rescan_not_the_scan(dataset: tuple[Path, Any], run_scan: RunScan, tmp_path: Path):
    root, made = dataset
    out = tmp_path / "out"
    assert run_scan([root, "--out", out, "--allow-oversubscription"]).returncode == 0
    rows = (out / "metadata.parquet").read_bytes()
    (out / ".scan-state.parquet").write_bytes(b"PAR1 not really parquet")
    proc = run_scan([root, "--out", out, "--allow-oversubscription"])
    assert proc.returncode == 0, proc.stderr
    assert summary_of(proc)["scanned"] == len(made)
    assert pq.read_table(io.BytesIO(rows)).equals(pq.read_table(out / "metadata.parquet"))
