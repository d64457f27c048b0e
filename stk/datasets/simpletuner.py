"""SimpleTuner's `multidatabackend.json` as stk datasets.

What each key means is taken from SimpleTuner's documentation/DATALOADER.md, and its defaults from its code
(data_backend/config/image.py, helpers/prompts.py): a JSON list of backends, each
with an `id`; image datasets (`dataset_type` image or absent) on a `local` directory or an `aws` bucket become
stk datasets; the text-embed, image-embed and conditioning backends and every key stk has no use for
become one warning line each.
"""

from __future__ import annotations

import math
from typing import Any

from stk.datasets.convert import Fields, dataset_name, number
from stk.datasets.spec import DatasetSpec, dataset_from_table
from stk.errors import InputError
from stk.metadata import DEFAULT_ALIASES

__all__ = ["convert"]

_CACHE_BACKENDS = ("text_embeds", "image_embeds", "conditioning_image_embeds")
_CREDENTIALS = "is not carried: boto3 reads S3 credentials from its usual chain (AWS_ACCESS_KEY_ID, AWS_PROFILE)"
_REASONS = {
    "aws_endpoint_url": "is not carried: give stk-scan --s3-endpoint-url (or [s3] endpoint_url in --config)",
    "aws_region_name": "is not carried: boto3 reads the region from AWS_REGION or its config",
    "aws_access_key_id": _CREDENTIALS,
    "aws_secret_access_key": _CREDENTIALS,
    "cache_dir_vae": "is not carried: stk-cache --out holds the cache; ignored",
    "text_embeds": "is not carried: stk-cache --out holds the text embeddings; ignored",
    "image_embeds": "is not carried: stk-cache --out holds the latents; ignored",
}
# What each caption strategy is in stk (SimpleTuner's helpers/prompts.py): `textfile` reads the .txt beside each
# image and fails one without it; `filename`, its default, captions every image by its file's stem with each '_' a
# space, whatever files lie beside it.
_CAPTIONS = {
    "textfile": {"caption-extension": ".txt", "missing-caption": "error"},
    "filename": {"captions": "stem"},
}
_DEFAULT_STRATEGY = "filename"  # SimpleTuner's --caption_strategy default, which a dataset without its own takes


def convert(entries: list[Any], path: str) -> tuple[list[DatasetSpec], list[str]]:
    """The image datasets of the list, in its order, and the warnings about what was left out."""
    specs: list[DatasetSpec] = []
    warnings: list[str] = []
    for position, entry in enumerate(entries, 1):
        if not isinstance(entry, dict):
            raise InputError(f"{path}, entry {position}: not a JSON object")
        ident = entry.get("id")
        if not isinstance(ident, str) or not ident:
            raise InputError(f"{path}, entry {position}: no id")
        where = f"{path}, dataset {ident!r}"
        skipped = _skipped(entry)
        if skipped:
            warnings.append(f"{where}: {skipped}; skipped")
            continue
        fields = Fields(entry, where, _REASONS)
        table = _table(fields, ident)
        warnings.extend(fields.rest())
        specs.append(dataset_from_table(table, where))
    return specs, warnings


def _skipped(entry: dict[str, Any]) -> str | None:
    """Why a backend is not an stk dataset, or None when it is one."""
    if entry.get("disabled") is True or entry.get("disable") is True:
        return "disabled"
    kind = entry.get("dataset_type") or "image"
    if kind in _CACHE_BACKENDS:
        return f"dataset_type {kind} is a cache backend (stk-cache writes its own cache)"
    if kind != "image":
        return f"dataset_type {kind} is not supported by stk (images only)"
    storage = entry.get("type") or "local"
    if storage not in ("local", "aws"):
        return f"type {storage} is not supported by stk (a local directory or an aws bucket)"
    return None


def _table(fields: Fields, ident: str) -> dict[str, Any]:
    """The `[[dataset]]` table of one image dataset, taking the keys it understands from `fields`."""
    for key in ("id", "dataset_type", "disabled", "disable"):
        fields.take(key)  # read by convert and _skipped
    storage = fields.take("type") or "local"
    name = dataset_name(ident)
    if name != ident:
        fields.warn("id", f"{ident!r} is named {name!r} in stk (letters, digits, '.', '_', '-')")
    table: dict[str, Any] = {"name": name}
    _source(fields, table, storage)
    repeats = fields.take("repeats")
    if repeats is None:
        repeats = 0  # SimpleTuner's default, said here: stk's --repeats must not stand in for it
    if isinstance(repeats, bool) or not isinstance(repeats, int):
        raise InputError(f"{fields.where}: repeats = {repeats!r} is not an integer")
    # SimpleTuner's repeats count the passes after the first (0: each image seen once per epoch);
    # stk's count every pass (1: seen once). So stk's repeats are SimpleTuner's plus one.
    table["repeats"] = repeats + 1
    for theirs, ours in (
        ("probability", "weight"),
        ("minimum_aspect_ratio", "min-aspect"),
        ("maximum_aspect_ratio", "max-aspect"),
        ("caption_dropout_probability", "caption-dropout"),
    ):
        value = fields.take(theirs)
        if value is not None:
            table[ours] = value
    _resolution(fields, table)
    _crop(fields, table)
    return table


def _source(fields: Fields, table: dict[str, Any], storage: str) -> None:
    """`source` (and for a parquet table `root` and `caption-column`) from where the images are and the
    caption strategy."""
    images = _images(fields, storage)
    strategy = fields.take("caption_strategy") or _DEFAULT_STRATEGY
    parquet = fields.take("parquet")
    backend = fields.take("metadata_backend")
    if strategy == "parquet":
        table.update(_parquet(fields, parquet, images))
        parquet = None
    else:
        table["source"] = images
        if strategy in _CAPTIONS:
            table.update(_CAPTIONS[strategy])
        else:
            instead = "captions from .txt/.caption files, else stk-scan's --missing-caption"
            fields.warn(
                "caption_strategy", f"{strategy} is not supported by stk (textfile, filename, parquet): {instead}"
            )
    if parquet is not None:
        fields.warn("parquet", "is used by stk only with caption_strategy parquet; ignored")
    if backend not in (None, "discovery", "parquet"):
        fields.warn("metadata_backend", f"{backend} is not supported by stk (stk-scan reads each image); ignored")


def _images(fields: Fields, storage: str) -> str:
    """The directory or s3:// prefix the images are in."""
    if storage == "local":
        directory = fields.take("instance_data_dir")
        if not isinstance(directory, str):
            raise InputError(f"{fields.where}: no instance_data_dir")
        return directory
    bucket, prefix = fields.take("aws_bucket_name"), fields.take("aws_data_prefix") or ""
    if not isinstance(bucket, str) or not isinstance(prefix, str):
        raise InputError(f"{fields.where}: type aws needs aws_bucket_name (and aws_data_prefix, a string)")
    return f"s3://{bucket}/{prefix.strip('/')}".rstrip("/")


def _parquet(fields: Fields, block: Any, images: str) -> dict[str, Any]:
    """A parquet (or JSONL) table's source: its `path` (read through the dataset's own storage, so a key of
    the bucket for type aws), the images as the root of its file names, and its caption column."""
    if not isinstance(block, dict) or not isinstance(block.get("path"), str):
        raise InputError(f"{fields.where}: caption_strategy parquet needs a parquet block with a path")
    parquet = Fields({f"parquet.{key}": value for key, value in block.items()}, fields.where, {})
    table_path = parquet.take("parquet.path")
    if images.startswith("s3://") and not table_path.startswith("s3://"):
        table_path = f"s3://{images[len('s3://') :].partition('/')[0]}/{table_path.lstrip('/')}"
    out = {"source": table_path, "root": images}
    caption = parquet.take("parquet.caption_column")
    if caption is not None:
        out["caption-column"] = caption
    for ours in ("path", "width", "height"):
        key = f"parquet.{'filename' if ours == 'path' else ours}_column"
        column = parquet.take(key)
        if column is not None and column not in DEFAULT_ALIASES[ours]:
            parquet.warn(key, f"{column!r}: stk reads the {ours} column as one of {', '.join(DEFAULT_ALIASES[ours])}")
    if parquet.take("parquet.identifier_includes_extension") is not True:
        # SimpleTuner's default: it appends .png to each file name; stk takes the column as the file's name
        parquet.warn("parquet.identifier_includes_extension", "is not true: stk needs file names with their extension")
    fields.warnings.extend(parquet.rest())
    return out


def _resolution(fields: Fields, table: dict[str, Any]) -> None:
    """`resolution` and `resolution_type` (pixel: the short edge in pixels; area: megapixels; pixel_area: the
    area of a square of that edge, in pixels, so 1024 is 1024*1024 = 1.048576 megapixels), and
    `minimum_image_size` in the same unit (stk's min-size is the short edge, so only with pixel)."""
    value, kind, minimum = fields.take("resolution"), fields.take("resolution_type"), fields.take("minimum_image_size")
    if kind not in (None, "pixel", "area", "pixel_area"):
        raise InputError(f"{fields.where}: resolution_type = {kind!r}, expected one of pixel, area, pixel_area")
    if value is not None:
        edge = number(value, "resolution", fields.where)
        if kind == "pixel_area":
            table["resolution"], table["resolution-type"] = edge * edge / 1e6, "area"
        else:
            table["resolution"] = edge
            if kind is None:
                fields.warn("resolution", "has no resolution_type: stk-scan's --resolution-type applies to it")
            else:
                table["resolution-type"] = kind
    elif kind is not None:
        fields.warn("resolution_type", "without resolution: left to stk-scan's --resolution and --resolution-type")
    if minimum is not None:
        least = number(minimum, "minimum_image_size", fields.where)
        if kind == "pixel":
            table["min-size"] = math.ceil(least)  # an image below it is left out: 767.5 keeps 768, not 767
        elif least > 0:
            fields.warn("minimum_image_size", "is an area here; stk's min-size is the short edge in pixels; ignored")


def _crop(fields: Fields, table: dict[str, Any]) -> None:
    """`crop` true with `crop_style` center or random (SimpleTuner's default style: random) and `crop_aspect`
    (its default: square)."""
    crop, style, aspect = fields.take("crop"), fields.take("crop_style"), fields.take("crop_aspect")
    if crop is True:
        style = "random" if style is None else style
        if style in ("center", "random"):
            table["crop"] = style
        else:
            fields.warn("crop_style", f"{style} is not supported by stk (center, random); left to stk-cache's --crop")
        _crop_aspect(fields, table, aspect or "square")
        return
    if crop is not None:
        fields.warn("crop", "is not true: stk crops every image to its bucket; left to stk-cache's --crop")
    for key, value in (("crop_style", style), ("crop_aspect", aspect)):
        if value is not None:
            fields.warn(key, "applies only with crop true; ignored")


def _crop_aspect(fields: Fields, table: dict[str, Any], aspect: str) -> None:
    """square: one square bucket; preserve (each image's own aspect) is stk's aspect buckets; closest and random
    pick from `crop_aspect_buckets`, where stk takes the bucket nearest each image's aspect."""
    if aspect == "square":
        table["aspect"] = "square"
    elif aspect in ("closest", "random"):
        listed = " (not crop_aspect_buckets)" if fields.take("crop_aspect_buckets") is not None else ""
        fields.warn("crop_aspect", f"{aspect}: stk crops each image to the nearest of its own aspect buckets{listed}")
    elif aspect != "preserve":
        fields.warn("crop_aspect", f"{aspect} is not supported by stk (square, preserve); stk's aspect buckets apply")
