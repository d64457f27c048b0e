"""The mode of a file stk writes: what `open()` would give it, 0666 less the umask.

Files made another way come out 0600: `tempfile.mkstemp` (stk's atomic writes fill a temp file and rename it) and
safetensors' writer. On shared storage that locks out the team: another user's stk-cache could not read the scan,
nor their stk-train the cache. Every such file passes through `honour_umask` before it is renamed into place.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["honour_umask", "umask"]


def umask() -> int:
    """The process's umask, read without setting it: `os.umask` can only be read by setting it, and a thread that
    creates a file meanwhile would get the temporary one."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:  # no /proc (not Linux): the usual way
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def honour_umask(target: int | str | Path) -> None:
    """Give a file (an open descriptor or a path), or every file under a folder, the mode `open()` would have."""
    mode = 0o666 & ~umask()
    if isinstance(target, int):
        os.fchmod(target, mode)
        return
    path = Path(target)
    files = (p for p in path.rglob("*") if p.is_file() and not p.is_symlink()) if path.is_dir() else [path]
    for file in files:
        file.chmod(mode)
