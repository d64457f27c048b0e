"""The image formats stk trains on, and the one place that readies Pillow to open them.

Every module that opens an image (the scan's header reader, the cache's and the trainer's
decoder) calls `open_image()`, so that the plugins for HEIC and JPEG XL are registered, Pillow's
own bomb check and warnings are off (stk applies --max-pixels and reports bad files itself), and
libtiff prints nothing on stderr, wherever the image is opened.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from typing import BinaryIO

from PIL import Image, ImageFile

__all__ = [
    "ACCEPTED",
    "FORMAT_NAMES",
    "IMAGE_EXTENSIONS",
    "accepted_formats",
    "open_image",
    "ready_pillow",
]

# --formats names -> the format names Pillow (and its plugins) report for them.
FORMAT_NAMES: dict[str, frozenset[str]] = {
    "jpeg": frozenset({"JPEG", "MPO"}),  # MPO: a JPEG with extra frames (phone depth maps)
    "png": frozenset({"PNG"}),
    "webp": frozenset({"WEBP"}),
    "gif": frozenset({"GIF"}),
    "bmp": frozenset({"BMP"}),
    "tiff": frozenset({"TIFF"}),
    "avif": frozenset({"AVIF"}),
    "heic": frozenset({"HEIF"}),
    "jxl": frozenset({"JXL"}),
    "jp2": frozenset({"JPEG2000"}),
    "tga": frozenset({"TGA"}),
    "pnm": frozenset({"PPM"}),  # PPM, PGM and PBM
}
ACCEPTED = frozenset().union(*FORMAT_NAMES.values())

# Files with these extensions are treated as images: those of a format stk cannot train on become
# error rows (unsupported_format, the format named) instead of being passed over in silence.
_COMMON = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".apng", ".webp", ".gif", ".bmp", ".dib", ".tif", ".tiff")
_NEWER = (".avif", ".heic", ".heif", ".hif", ".jxl", ".jp2", ".j2k", ".j2c", ".jpx", ".jpf")
_OLDER = (".tga", ".icb", ".vda", ".vst", ".ppm", ".pgm", ".pbm", ".pnm", ".pam")
_UNTRAINED = (".psd", ".dds", ".ico", ".svg")  # not trained on: reported as unsupported_format
IMAGE_EXTENSIONS = frozenset(_COMMON + _NEWER + _OLDER + _UNTRAINED)
# Formats that Pillow cannot identify, named from the file's extension in the error row.
EXTENSION_FORMATS = {".svg": "SVG", ".pam": "PAM"}


def accepted_formats(names: str | None) -> frozenset[str]:
    """The Pillow format names a `--formats` comma list allows (all of them for None)."""
    if names is None:
        return ACCEPTED
    chosen = [name.strip().lower() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in FORMAT_NAMES]
    if unknown or not chosen:
        raise ValueError(
            f"{names!r}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
            f"choose from {','.join(FORMAT_NAMES)}"
        )
    return frozenset().union(*(FORMAT_NAMES[name] for name in chosen))


@functools.cache
def ready_pillow() -> None:
    """Register the plugins and quiet the C libraries, once per process."""
    import pillow_heif
    import pillow_jxl  # noqa: F401  (importing it registers the JPEG XL plugin)

    pillow_heif.register_heif_opener()
    Image.MAX_IMAGE_PIXELS = None
    # Pillow warns about odd files (corrupt EXIF...); stk reports bad files itself. One filter for the
    # process: warnings.catch_warnings() per call is not thread-safe and leaks filters across threads.
    warnings.filterwarnings("ignore", module=r"PIL\.")
    warnings.filterwarnings("ignore", module=r"pillow_(heif|jxl)")
    _quiet_libtiff()


def open_image(f: BinaryIO) -> ImageFile.ImageFile:
    """Pillow's lazy `Image.open`, with every format stk reads available."""
    ready_pillow()
    return Image.open(f)


def _quiet_libtiff() -> None:
    """libtiff prints its warnings and errors on stderr itself ("WEBP compression support is not
    configured"); a decode that fails still raises in Pillow, and stk reports it on the file's row."""
    from PIL import _imaging  # noqa: F401  (loads the libtiff that Pillow uses)

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libtiff" in line}
    except OSError:
        return
    for path in paths:
        if os.path.basename(path).startswith("libtiff") and os.path.exists(path):
            library = ctypes.CDLL(path)
            library.TIFFSetWarningHandler(None)
            library.TIFFSetErrorHandler(None)
