"""The one place where a failing disk becomes an error for people.

A full disk, an exhausted quota, a file over the size limit (EFBIG: the file system's, or the
process's `ulimit -f`), a file system remounted read-only or a failing device are the
infrastructure's fault (InfraError, exit 69: rerun, maybe elsewhere); permission denied is the
user's to fix (InputError, exit 3), except in the middle of a save (`saving`): the output was
writable when the run started, so a checkpoint that cannot be written is the infrastructure's
fault too (exit 69, requeued). Python reports these as OSError with an errno; h5py reports
them as OSError or RuntimeError with the errno only inside HDF5's multi-line message
("..., errno = 28, error message = 'No space left on device', ..."). Either way the person gets
one line: what failed, the path, and what to do. Other libraries put the errno in their text
(safetensors, shutil) or lose it (torch.save): then the disk itself is asked.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator

from stk.errors import InfraError, InputError, StkError

__all__ = ["as_stk_error", "disk_error", "disk_state_error", "storage_errors"]

_RERUN = "then rerun the same command (finished work is kept)"
_INFRA = {
    errno.ENOSPC: "cannot write {}: no space left on the device; free space there (or write elsewhere), " + _RERUN,
    errno.EDQUOT: "cannot write {}: disk quota exceeded; free space or raise the quota, " + _RERUN,
    errno.EROFS: "cannot write {}: the file system is read-only; remount it read-write (or write elsewhere), " + _RERUN,
    errno.EIO: "input/output error at {}: the disk or network file system failed; rerun, maybe on another node",
    errno.EFBIG: "cannot write {}: the file is larger than its file system or the file-size limit (ulimit -f) allows; "
    "write it elsewhere or raise the limit, " + _RERUN,
}
_INPUT = {
    errno.EACCES: "permission denied: {}; give the user running stk access to it, or use another location",
    errno.EPERM: "operation not permitted: {}; give the user running stk access to it, or use another location",
}
_KNOWN = {**_INFRA, **_INPUT}
_NEARLY_FULL = 16 * 2**20  # free bytes under which a failed write is taken for a full disk
# errno inside messages: HDF5's "errno = 28", Rust's "(os error 28)" (safetensors), Python's
# "[Errno 28]" inside shutil.Error's list
_ERRNO_IN_TEXT = re.compile(r"errno = (\d+)|\(os error (\d+)\)|\[Errno (\d+)\]")
_NAME_IN_TEXT = re.compile(r"name = '([^']*)'")


def _errno_and_path(exc: BaseException) -> tuple[int | None, str | None]:
    code = exc.errno if isinstance(exc, OSError) else None
    path = exc.filename if isinstance(exc, OSError) else None
    text = str(exc)
    if code not in _KNOWN:
        match = _ERRNO_IN_TEXT.search(text)
        code = int(next(g for g in match.groups() if g)) if match else code
    if path is None:
        match = _NAME_IN_TEXT.search(text)
        path = match.group(1) if match else None
    return code, None if path is None else os.fsdecode(path)


def as_stk_error(exc: BaseException, path: str | None = None, where: str = "", saving: bool = False) -> StkError | None:
    """The StkError for a disk failure (`path` names the file when the error does not), or None
    when `exc` is not one: the caller then lets it through as it is. `saving`: every one is an InfraError."""
    if not isinstance(exc, Exception) or isinstance(exc, StkError):
        return None
    code, named = _errno_and_path(exc)
    if code is None or code not in _KNOWN:
        return None
    target = path or named or "(path unknown)"
    prefix = f"{where}: " if where else ""
    if code in _INFRA:
        return InfraError(prefix + _INFRA[code].format(target))
    if saving:
        return InfraError(prefix + _INPUT[code].format(target) + ", " + _RERUN)
    return InputError(prefix + _INPUT[code].format(target))


def disk_state_error(path: str, where: str = "", saving: bool = False) -> StkError | None:
    """The error for a disk that is read-only or (nearly) full, judged from the disk itself: for
    libraries whose errors lose the errno (torch.save: "unexpected pos 58048 vs 57942")."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        disk = os.statvfs(existing)
    except OSError:
        return None
    if disk.f_flag & os.ST_RDONLY:
        code = errno.EROFS
    elif disk.f_bavail * disk.f_frsize < _NEARLY_FULL:
        code = errno.ENOSPC
    else:
        return None
    return as_stk_error(OSError(code, os.strerror(code)), path, where, saving)


def disk_error(exc: BaseException, path: str | None = None, where: str = "", saving: bool = False) -> StkError | None:
    """`exc` as `storage_errors` raises it, or None for an error that is no disk's. While `saving`, an error
    already made one (a permission denied, exit 3, from a nested writer) is judged again from its cause."""
    if saving and isinstance(exc, InputError) and exc.__cause__ is not None:
        exc = exc.__cause__
    error = as_stk_error(exc, path, where, saving)
    if error is None and path is not None and isinstance(exc, (OSError, RuntimeError)):
        error = disk_state_error(path, where, saving)
    return error


@contextlib.contextmanager
def storage_errors(path: str | None = None, where: str = "", saving: bool = False) -> Iterator[None]:
    """Raise disk failures inside the block as StkErrors (see `as_stk_error`); others pass. With a
    `path`, an error that names no errno is one too when that path's disk is full or read-only."""
    try:
        yield
    except Exception as exc:
        error = disk_error(exc, path, where, saving)
        if error is None:
            raise
        raise error from exc
