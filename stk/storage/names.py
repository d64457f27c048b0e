"""File names that are not UTF-8, in tables and reports that must be UTF-8.

Python gives such a name with each undecodable byte as a surrogate escape (os.fsdecode), which
opens the file but cannot be written to parquet or JSON. Tables hold `name_text(name)` instead:
each undecodable byte as `\\xNN`, and, in those names only or where a name already holds text of
that form, each backslash doubled. Every other name is stored as it is, and `text_name` turns the
text back into the name that opens the file, so stk-cache and stk-train find the same file.
"""

from __future__ import annotations

import os
import re

__all__ = ["name_text", "printable", "text_name"]

_ESCAPE = re.compile(r"\\(\\|x[0-9a-fA-F]{2})")


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(text: str) -> str:
    """`text` with any undecodable byte of a file name shown as `\\xNN`: for messages and reasons."""
    if _is_utf8(text):
        return text
    try:
        raw = os.fsencode(text)
    except UnicodeEncodeError:  # a surrogate no file name holds (from a JSON table): shown as \\udXXX
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def name_text(name: str) -> str:
    """The UTF-8 text a table stores for a file name as Python gives it (surrogate escapes)."""
    if _is_utf8(name) and not _ESCAPE.search(name):
        return name
    return printable(name.replace("\\", "\\\\"))


def text_name(text: str) -> str:
    """The file name that `name_text` stored as `text`: the inverse, so `text_name(name_text(n)) == n`."""
    if "\\" not in text:
        return text
    raw = bytearray()
    start = 0
    for match in _ESCAPE.finditer(text):
        raw += os.fsencode(text[start : match.start()])
        token = match.group(1)
        raw += b"\\" if token == "\\" else bytes([int(token[1:], 16)])
        start = match.end()
    raw += os.fsencode(text[start:])
    return os.fsdecode(bytes(raw))
