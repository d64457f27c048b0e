"""Unit tests for stk.storage on local paths: listing, reading and atomic writes."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from stk import storage
from stk.errors import InputError


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "empty_dir").mkdir()
    (root / "a.txt").write_bytes(b"alpha")
    (root / "sub" / "b.jpg").write_bytes(b"b" * 10)
    (root / "sub" / "deeper" / "c.png").write_bytes(b"c" * 100)
    (root / "sub" / "deeper" / "name with space.gif").write_bytes(b"")
    return root


def listing(root: Path) -> dict[str, storage.FileInfo]:
    infos = list(storage.list_files(str(root)))
    by_key = {info.key: info for info in infos}
    assert len(by_key) == len(infos), "a key was listed twice"
    return by_key


@pytest.fixture
def umask() -> Iterator[None]:
    saved = os.umask(0o022)
    os.umask(saved)
    yield
    os.umask(saved)


# --- list_files -------------------------------------------------------------------------------------


def test_list_files_is_recursive_with_relative_keys(tree: Path) -> None:
    files = listing(tree)
    assert set(files) == {"a.txt", "sub/b.jpg", "sub/deeper/c.png", "sub/deeper/name with space.gif"}
    for key, info in files.items():
        assert info.location == str(tree / key)
        assert info.error is None
        assert info.etag is None
    assert (files["a.txt"].size, files["sub/b.jpg"].size, files["sub/deeper/c.png"].size) == (5, 10, 100)
    assert files["sub/deeper/name with space.gif"].size == 0


def test_list_files_reports_mtime(tree: Path) -> None:
    os.utime(tree / "a.txt", ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    assert listing(tree)["a.txt"].mtime == pytest.approx(1_600_000_000.123456789, abs=1e-6)


def test_list_files_with_a_trailing_slash(tree: Path) -> None:
    files = {info.key for info in storage.list_files(str(tree) + "/")}
    assert files == set(listing(tree))


def test_broken_symlink_is_listed_with_an_error(tree: Path) -> None:
    (tree / "sub" / "gone.jpg").symlink_to(tree / "does-not-exist.jpg")
    files = listing(tree)
    broken = files["sub/gone.jpg"]
    assert broken.error == "broken symlink"
    assert broken.size == 0
    assert broken.location == str(tree / "sub" / "gone.jpg")
    assert all(info.error is None for key, info in files.items() if key != "sub/gone.jpg")


def test_symlink_to_a_file_lists_as_that_file(tree: Path) -> None:
    (tree / "link.png").symlink_to(tree / "sub" / "deeper" / "c.png")
    info = listing(tree)["link.png"]
    assert (info.size, info.error) == (100, None)


def test_symlink_to_a_directory_is_not_followed(tree: Path) -> None:
    (tree / "sub" / "loop").symlink_to(tree, target_is_directory=True)  # a cycle if followed
    (tree / "elsewhere").symlink_to(tree / "sub", target_is_directory=True)
    files = listing(tree)
    assert set(files) == {"a.txt", "sub/b.jpg", "sub/deeper/c.png", "sub/deeper/name with space.gif"}


def test_empty_directory_lists_nothing(tmp_path: Path) -> None:
    assert list(storage.list_files(str(tmp_path))) == []


@pytest.mark.parametrize("what", ["missing", "file"])
def test_list_files_needs_a_directory(tmp_path: Path, what: str) -> None:
    target = tmp_path / "target"
    if what == "file":
        target.write_bytes(b"x")
    with pytest.raises(InputError, match="no such directory"):
        list(storage.list_files(str(target)))


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root can list any directory (tests/integration/test_scan_cli.py drops that)"
)
def test_an_unlistable_subdirectory_is_one_error_entry_and_the_rest_is_listed(tree: Path) -> None:
    locked = tree / "sub" / "deeper"
    locked.chmod(0)
    try:
        files = listing(tree)
    finally:
        locked.chmod(0o755)
    entry = files.pop("sub/deeper/")
    assert (entry.error_kind, entry.error) == ("unreadable", "cannot list directory: Permission denied")
    assert set(files) == {"a.txt", "sub/b.jpg"}


def test_an_unlistable_root_is_an_input_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def scandir(path: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(InputError, match="cannot list"):
        list(storage.list_files(str(tmp_path)))


@pytest.fixture
def specials(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """A FIFO, a socket and a directory, each with an image name."""
    paths = {"fifo": tmp_path / "fifo.jpg", "socket": tmp_path / "socket.png", "directory": tmp_path / "dir.png"}
    os.mkfifo(paths["fifo"])
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(paths["socket"]))
    paths["directory"].mkdir()
    yield paths
    server.close()


@pytest.mark.timeout(20)  # a FIFO opened for reading without a writer would block forever
@pytest.mark.parametrize("what", ["fifo", "socket", "directory"])
def test_reading_what_is_not_a_regular_file_is_refused_before_it_is_opened(
    specials: dict[str, Path], what: str
) -> None:
    location = str(specials[what])
    article = {"fifo": "a FIFO", "socket": "a socket", "directory": "a directory"}[what]
    for read in (storage.read_bytes, storage.open_read):
        with pytest.raises(storage.NotAFileError, match=f"{location}: is {article}, not a regular file"):
            read(location)
    info = storage.stat(location)
    assert (info.error_kind, info.error) == ("not_a_file", f"is {article}, not a regular file")


def test_fifos_and_sockets_are_listed_as_not_a_file(specials: dict[str, Path], tmp_path: Path) -> None:
    files = listing(tmp_path)
    assert {key: info.error_kind for key, info in files.items()} == {
        "fifo.jpg": "not_a_file",
        "socket.png": "not_a_file",
    }
    assert files["fifo.jpg"].error == "is a FIFO, not a regular file"


@pytest.mark.skipif(not Path("/dev/null").is_char_device(), reason="no /dev/null")
def test_a_device_is_not_a_file() -> None:
    assert storage.stat("/dev/null").error == "is a character device, not a regular file"
    with pytest.raises(storage.NotAFileError):
        storage.read_bytes("/dev/null")


# --- names that are not UTF-8 ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"cat.jpg", "cat.jpg"),
        ("caf\u00e9.png".encode(), "caf\u00e9.png"),  # UTF-8: as it is
        (b"a\\b.jpg", "a\\b.jpg"),  # a backslash alone: as it is
        (b"\xff\xfe.jpg", "\\xff\\xfe.jpg"),  # each undecodable byte as \xNN
        (b"d\\\xe9.jpg", "d\\\\\\xe9.jpg"),  # with its backslashes doubled
        (b"\\xff.jpg", "\\\\xff.jpg"),  # a UTF-8 name that reads like an escape: doubled too
        (b"\\\\.jpg", "\\\\\\\\.jpg"),
        (b"\xed\xa0\x80.jpg", "\\xed\\xa0\\x80.jpg"),  # an encoded surrogate is not UTF-8 either
    ],
)
def test_names_are_stored_as_utf8_text_that_gives_the_name_back(raw: bytes, text: str) -> None:
    name = os.fsdecode(raw)  # as os.listdir and os.scandir give it
    assert storage.name_text(name) == text
    text.encode("utf-8")  # what parquet and JSON need
    assert storage.text_name(text) == name
    assert os.fsencode(storage.text_name(text)) == raw


def test_printable_shows_undecodable_bytes_and_never_fails() -> None:
    assert storage.printable("cannot read /d/" + os.fsdecode(b"\xff.jpg")) == "cannot read /d/\\xff.jpg"
    assert storage.printable("a JSON table's lone \ud800") == "a JSON table's lone \\ud800"
    assert storage.printable("plain") == "plain"


# --- reading ----------------------------------------------------------------------------------------


def test_read_bytes_and_open_read(tree: Path) -> None:
    location = str(tree / "sub" / "deeper" / "c.png")
    assert storage.read_bytes(location) == b"c" * 100
    with storage.open_read(location, 100) as f:
        assert f.seekable()
        f.seek(95)
        assert f.read() == b"ccccc"
        f.seek(0)
        assert f.read(3) == b"ccc"
    with storage.open_read(str(tree / "a.txt")) as f:
        assert f.read() == b"alpha"


def test_reading_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        storage.open_read(str(tmp_path / "nope"))


def test_stat(tree: Path) -> None:
    location = str(tree / "sub" / "b.jpg")
    info = storage.stat(location)
    assert (info.location, info.size, info.error) == (location, 10, None)
    assert info.mtime == pytest.approx(os.stat(location).st_mtime)
    with pytest.raises(FileNotFoundError):
        storage.stat(str(tree / "nope"))


def test_exists(tree: Path) -> None:
    assert storage.exists(str(tree / "a.txt"))
    assert storage.exists(str(tree / "sub"))
    assert not storage.exists(str(tree / "a.txt.caption"))
    (tree / "dangling").symlink_to(tree / "nothing")
    assert not storage.exists(str(tree / "dangling"))


# --- write_atomic ------------------------------------------------------------------------------------


def test_write_atomic_creates_directories_and_leaves_no_temp_files(tmp_path: Path, umask: None) -> None:
    location = tmp_path / "new" / "dir" / "out.json"
    storage.write_atomic(str(location), b'{"ok": true}\n')
    assert location.read_bytes() == b'{"ok": true}\n'
    assert os.listdir(location.parent) == ["out.json"]


def test_write_atomic_replaces_content(tmp_path: Path, umask: None) -> None:
    location = tmp_path / "out.bin"
    location.write_bytes(b"old content that is longer")
    storage.write_atomic(str(location), b"new")
    assert location.read_bytes() == b"new"
    storage.write_atomic(str(location), b"")
    assert location.read_bytes() == b""
    assert os.listdir(tmp_path) == ["out.bin"]


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_write_atomic_gives_the_usual_permissions(tmp_path: Path, umask: None, mask: int, mode: int) -> None:
    os.umask(mask)
    location = tmp_path / "out.bin"
    storage.write_atomic(str(location), b"x")
    assert stat.S_IMODE(os.stat(location).st_mode) == mode


def test_write_atomic_in_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, umask: None) -> None:
    monkeypatch.chdir(tmp_path)
    storage.write_atomic("here.txt", b"relative")
    assert (tmp_path / "here.txt").read_bytes() == b"relative"
    assert os.listdir(tmp_path) == ["here.txt"]


def test_write_atomic_failure_removes_the_temp_file(tmp_path: Path, umask: None) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_bytes(b"")  # a non-empty directory cannot be replaced by a file
    with pytest.raises(OSError):
        storage.write_atomic(str(target), b"data")
    assert sorted(os.listdir(tmp_path)) == ["target"]
    assert os.listdir(target) == ["keep"]


def test_write_atomic_under_a_file_fails(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError):
        storage.write_atomic(str(tmp_path / "file" / "out.bin"), b"x")


# --- join / is_s3 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("root", "key", "expected"),
    [
        ("/data", "a/b.jpg", "/data/a/b.jpg"),
        ("/data/", "a/b.jpg", "/data/a/b.jpg"),
        ("/data//", "/a/b.jpg", "/data/a/b.jpg"),
        ("relative", "x.png", "relative/x.png"),
        ("", "x.png", "x.png"),
        ("s3://bucket/prefix", "k/x.png", "s3://bucket/prefix/k/x.png"),
        ("s3://bucket/prefix/", "k/x.png", "s3://bucket/prefix/k/x.png"),
        ("s3://bucket", "x.png", "s3://bucket/x.png"),
    ],
)
def test_join(root: str, key: str, expected: str) -> None:
    assert storage.join(root, key) == expected


@pytest.mark.parametrize(
    ("location", "expected"),
    [("s3://bucket/key", True), ("s3://b", True), ("/data/s3://x", False), ("data", False)],
)
def test_is_s3(location: str, expected: bool) -> None:
    assert storage.is_s3(location) is expected


def test_local_upload_and_download_copy_atomically(tmp_path: Path) -> None:
    source = tmp_path / "a.bin"
    source.write_bytes(os.urandom(100_000))
    storage.upload_file(str(source), str(tmp_path / "sub" / "b.bin"))
    storage.download_file(str(tmp_path / "sub" / "b.bin"), str(tmp_path / "c" / "c.bin"))
    assert (tmp_path / "c" / "c.bin").read_bytes() == source.read_bytes()
    assert sorted(os.listdir(tmp_path / "sub")) == ["b.bin"]  # no temp file left behind
    with pytest.raises(FileNotFoundError):
        storage.download_file(str(tmp_path / "missing"), str(tmp_path / "d.bin"))
