"""stk-scan on every kind of bad input: broken files in a tree, table paths escaping the root, unreadable stdin
entries, fifos, sockets, unlistable directories, names that are not UTF-8, and every file of Pillow's own test
images: each one error row, the scan goes on."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import PIL
import pytest
from support.bad_inputs import without_dac_override
from support.commands import RunScan, scan_command, scan_env, summary_of
from support.scan_outputs import BAD_ARGS, GOOD, IS_ROOT, _errors, _no_traceback, _rows, _save_png

from stk.datagen import make_image
from stk.images.info import is_image_name

pytestmark = pytest.mark.integration


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
        input=listing,
        capture_output=True,
        env=scan_env(),
        timeout=40,
    )
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
