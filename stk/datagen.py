"""Small synthetic image datasets for the demo, the tests and the benchmarks.

Images are made with Pillow in every supported format, some stored rotated with an EXIF
orientation tag (as cameras do), most with a caption sidecar, so a scan exercises every path.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

from PIL import Image

__all__ = [
    "FORMATS",
    "FORMAT_SAMPLES",
    "FormatSample",
    "GeneratedImage",
    "generate_dataset",
    "generate_format_samples",
    "make_image",
]

FORMATS = {"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tif"}
_ORIENTATION = 0x0112


@dataclass(frozen=True)
class GeneratedImage:
    path: str  # relative to the dataset root
    width: int  # as displayed, after EXIF orientation
    height: int
    format: str
    caption: str | None  # None: no sidecar


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A cheap gradient image with a little texture (compresses like a simple photo)."""
    rng = random.Random(seed)
    base = Image.linear_gradient("L").resize((width, height))
    factors = [rng.randint(1, 3) for _ in range(3)]
    r, g, b = (base.point(lambda v, k=k: (v * k) % 256) for k in factors)
    return Image.merge("RGB", (r, g, b))


def save(image: Image.Image, path: str, fmt: str, orientation: int = 1, quality: int = 90) -> None:
    """Save as `fmt`; `orientation` 6 or 8 stores the pixels rotated with the matching tag."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    kwargs: dict[str, object] = {}
    if orientation != 1:
        # orientation 6 means "rotate 90 CW to display": store the pixels rotated 90 CCW
        image = image.transpose(Image.Transpose.ROTATE_90 if orientation == 6 else Image.Transpose.ROTATE_270)
        exif = Image.Exif()
        exif[_ORIENTATION] = orientation
        kwargs["exif"] = exif
    if fmt in ("JPEG", "WEBP"):
        kwargs["quality"] = quality
    if fmt == "GIF":
        image = image.convert("P")
    image.save(path, fmt, **kwargs)


def generate_dataset(
    root: str, count: int = 48, seed: int = 0, min_side: int = 64, max_side: int = 128
) -> list[GeneratedImage]:
    """`count` images in all formats and orientations under `root`, in two sub-folders; about
    one in six without a caption sidecar, captions alternating .txt and .caption."""
    rng = random.Random(seed)
    formats = list(FORMATS)
    made: list[GeneratedImage] = []
    for i in range(count):
        fmt = formats[i % len(formats)]
        width, height = rng.randrange(min_side, max_side + 1), rng.randrange(min_side, max_side + 1)
        orientation = 6 if fmt in ("JPEG", "WEBP", "PNG") and i % 5 == 0 else 1
        rel = f"{'portraits' if height > width else 'landscapes'}/img_{i:05d}{FORMATS[fmt]}"
        save(make_image(width, height, seed=i), os.path.join(root, rel), fmt, orientation)
        caption: str | None = None
        if i % 6 != 5:
            caption = f"a synthetic {fmt.lower()} image number {i}"
            ext = ".txt" if i % 2 == 0 else ".caption"
            with open(os.path.join(root, os.path.splitext(rel)[0] + ext), "w", encoding="utf-8") as f:
                f.write(caption + "\n")
        made.append(GeneratedImage(rel, width, height, fmt, caption))
    return made


# Formats beyond the common six, each written with and without orientation transforms where the
# format has them (AVIF/HEIC as irot/imir boxes, JPEG XL as an Exif box), and files whose
# metadata is damaged but whose pixels decode.
FORMAT_SAMPLES = {
    "AVIF": (".avif", range(1, 9)),
    "HEIF": (".heic", range(1, 9)),
    "JXL": (".jxl", (1, 6, 3)),
    "JPEG2000": (".jp2", (1,)),
    "TGA": (".tga", (1,)),
    "PPM": (".ppm", (1,)),
}


@dataclass(frozen=True)
class FormatSample:
    path: str  # relative to the root
    width: int  # as a decode that applies the orientation shows it
    height: int
    format: str  # Pillow's name
    verdict: str  # image | warning | error
    kind: str | None = None  # the errors.jsonl kind, for warning and error


def generate_format_samples(root: str, width: int = 72, height: int = 48) -> list[FormatSample]:
    """One file per format and orientation, plus the variants (J2K codestream, RLE TGA, PGM, PBM),
    damaged EXIF blocks, and formats stk does not train on; with what a scan must make of each."""
    from stk.images.formats import ready_pillow

    ready_pillow()
    made: list[FormatSample] = []
    image = make_image(width, height, seed=7)

    def write(
        name: str,
        fmt: str,
        turned: bool = False,
        verdict: str = "image",
        kind: str | None = None,
        pixels: Image.Image = image,
        save_as: str = "",
        **options: Any,
    ) -> None:
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if fmt == "SVG":
            with open(path, "w", encoding="utf-8") as f:
                f.write('<svg xmlns="http://www.w3.org/2000/svg"/>')
        else:
            pixels.save(path, save_as or fmt, **options)
        shown = (height, width) if turned else (width, height)
        made.append(FormatSample(name, *shown, fmt, verdict, kind))

    for fmt, (ext, orientations) in FORMAT_SAMPLES.items():
        for orientation in orientations:
            exif = Image.Exif()
            exif[_ORIENTATION] = orientation
            options: dict[str, Any] = {"exif": exif.tobytes()} if orientation != 1 else {}
            write(f"{fmt.lower()}/o{orientation}{ext}", fmt, orientation >= 5, **options)
    write("jpeg2000/codestream.j2k", "JPEG2000", no_jp2=True)
    write("tga/rle.tga", "TGA", compression="tga_rle")
    write("ppm/grey.pgm", "PPM", pixels=image.convert("L"))
    write("ppm/bits.pbm", "PPM", pixels=image.convert("1"))
    good = Image.Exif()
    good[_ORIENTATION] = 6
    cut = good.tobytes()[:-6]  # the IFD entry is cut short
    garbage = b"Exif\x00\x00" + bytes(random.Random(3).randrange(256) for _ in range(40))
    for name, raw in (("exif-cut.jpg", cut), ("exif-garbage.jpg", garbage)):
        write(f"damaged/{name}", "JPEG", False, "warning", "exif_unreadable", exif=raw)
    write("other/icon.ico", "ICO", False, "error", "unsupported_format")
    write("other/vector.svg", "SVG", False, "error", "unsupported_format")
    return made
