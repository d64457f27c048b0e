"""Unit tests for stk.captions: decoding sidecars, captions from file names, sidecar stems."""

from __future__ import annotations

import pytest

from stk.captions import (
    CAPTION_EXTENSIONS,
    CaptionError,
    caption_from_filename,
    caption_from_stem,
    decode_caption,
    sidecar_of,
    sidecar_stem,
)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"a cat on a sofa", "a cat on a sofa"),
        (b"a cat on a sofa\n", "a cat on a sofa"),
        (b"  \t a cat \r\n\r\n", "a cat"),
        (b"\xef\xbb\xbfa cat with a BOM\n", "a cat with a BOM"),
        (b"\xef\xbb\xbf", ""),
        (b"", ""),
        (b" \n\t ", ""),
        (b"line one\nline two\n", "line one\nline two"),  # inner newlines are kept
        (b"two  spaces", "two  spaces"),
        ("caf\u00e9 \u732b \U0001f408".encode(), "caf\u00e9 \u732b \U0001f408"),
    ],
)
def test_decode_caption(data: bytes, expected: str) -> None:
    assert decode_caption(data) == expected


def test_bom_only_dropped_at_the_start() -> None:
    assert decode_caption(b"a\xef\xbb\xbfb") == "a\ufeffb"


@pytest.mark.parametrize(
    ("data", "position"),
    [
        (b"caf\xe9 au lait", 3),  # Latin-1
        (b"\xff\xfea\x00b\x00", 0),  # UTF-16 LE with its BOM
        (b"ok then \x80", 8),
        (b"cut \xe2\x82", 4),  # a multi-byte sequence cut short
    ],
)
def test_non_utf8_raises_caption_error(data: bytes, position: int) -> None:
    with pytest.raises(CaptionError) as info:
        decode_caption(data)
    assert f"byte {position}" in str(info.value)
    assert "UTF-8" in str(info.value)
    assert isinstance(info.value.__cause__, UnicodeDecodeError)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("photos/my_cat-on_the-sofa.jpg", "my cat on the sofa"),
        ("a/b/__x__.png", "x"),
        ("dir.with.dots/file.name.jpg", "file.name"),
        ("nested/dir/IMG_0001.JPG", "IMG 0001"),
        ("no_extension", "no extension"),
        ("spaces  and--dashes__here.webp", "spaces and dashes here"),
        ("s3-bucket/x/sunset_over-the_sea.tif", "sunset over the sea"),
        ("a/b/.jpg", ".jpg"),  # a dot file has no extension
    ],
)
def test_caption_from_filename(key: str, expected: str) -> None:
    assert caption_from_filename(key) == expected


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("photos/my_cat-on_the-sofa.jpg", "my cat-on the-sofa"),  # only '_' becomes a space
        ("a/b/__x__.png", "  x  "),  # and nothing is trimmed
        ("dir.with.dots/file.name.jpg", "file.name"),
        ("s3://bucket/x/IMG_0001.JPG", "IMG 0001"),
    ],
)
def test_caption_from_stem_is_simpletuners_filename_caption(key: str, expected: str) -> None:
    assert caption_from_stem(key) == expected


@pytest.mark.parametrize(
    ("key", "extensions", "expected"),
    [
        ("a/cat.txt", CAPTION_EXTENSIONS, ("a/cat", 0)),
        ("a/cat.caption", CAPTION_EXTENSIONS, ("a/cat", 1)),
        ("a/cat.TXT", CAPTION_EXTENSIONS, ("a/cat", 0)),  # any case, as the listing always matched
        ("a/cat.txt", (".caption",), None),  # kohya's default reads no .txt
        ("a/cat.cap.txt", (".cap.txt",), ("a/cat", 0)),  # what kohya appends to the stem
        ("a/.txt", CAPTION_EXTENSIONS, None),  # no stem
        ("a/cat.png", CAPTION_EXTENSIONS, None),
        ("a/cat.txt", (), None),
    ],
)
def test_sidecar_of(key: str, extensions: tuple[str, ...], expected: tuple[str, int] | None) -> None:
    assert sidecar_of(key, extensions) == expected


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("a/b/cat.jpg", "a/b/cat"),
        ("a/b/cat.txt", "a/b/cat"),
        ("a/b/cat.caption", "a/b/cat"),
        ("cat.tar.gz", "cat.tar"),
        ("a.dir/cat", "a.dir/cat"),  # a dot in a folder name is not an extension
        ("s3://bucket/x/y.png", "s3://bucket/x/y"),
        ("cat", "cat"),
    ],
)
def test_sidecar_stem(key: str, expected: str) -> None:
    assert sidecar_stem(key) == expected


def test_image_and_its_sidecars_share_a_stem() -> None:
    stems = {sidecar_stem("set/img_00001.png"), *(sidecar_stem("set/img_00001" + ext) for ext in CAPTION_EXTENSIONS)}
    assert stems == {"set/img_00001"}
    assert sidecar_stem("set/img_00001.png") != sidecar_stem("set/img_00002.txt")
