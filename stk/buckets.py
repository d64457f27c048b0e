"""Aspect buckets and the effective-batch check.

A bucket is a (width, height) pair, both multiples of the alignment. The table is derived from
a resolution, either the short edge in pixels (`pixel`) or an area in megapixels (`area`), and
spans the allowed aspect ratios; an image goes to the bucket nearest its aspect ratio (in log
space, so 2:1 and 1:2 are equally far from 1:1). With `aspect` square the table is the one square
bucket, so every image is cropped square.
"""

from __future__ import annotations

import bisect
import enum
import math
from dataclasses import dataclass, field

from stk.errors import InputError

__all__ = [
    "MAX_SIDE",
    "Aspect",
    "BatchCheck",
    "Bucket",
    "BucketIndex",
    "BucketSpec",
    "ResolutionType",
    "ShortBucket",
    "check_batches",
    "effective_batch_size",
    "make_buckets",
    "nearest_aligned",
    "nearest_multiples",
    "ways_out",
]


MAX_SIDE = 65536  # px: the longest bucket side a spec may make (the table has about MAX_SIDE / alignment sizes)


class ResolutionType(str, enum.Enum):
    PIXEL = "pixel"  # resolution = short edge in pixels
    AREA = "area"  # resolution = megapixels


class Aspect(str, enum.Enum):
    BUCKETS = "buckets"  # a bucket per aspect ratio in [min_aspect, max_aspect]
    SQUARE = "square"  # one square bucket of the resolution (SimpleTuner's crop_aspect square)


@dataclass(frozen=True)
class Bucket:
    id: int
    width: int
    height: int

    @property
    def aspect(self) -> float:
        return self.width / self.height


@dataclass(frozen=True)
class BucketSpec:
    resolution: float = 1024.0
    resolution_type: ResolutionType = ResolutionType.PIXEL
    alignment: int = 64
    min_aspect: float = 0.5
    max_aspect: float = 2.0
    aspect: Aspect = Aspect.BUCKETS

    @property
    def side(self) -> float:
        """The side of the square bucket: the short edge (pixel), the square root of the area (area)."""
        return self.resolution if self.resolution_type is ResolutionType.PIXEL else math.sqrt(self.resolution * 1e6)

    def validate(self) -> None:
        """Checked before any work starts, so a bad spec fails at once rather than after a scan."""
        if self.alignment <= 0:
            raise InputError("alignment must be positive")
        if not 0 < self.min_aspect <= 1 <= self.max_aspect:
            raise InputError("aspect range must satisfy 0 < min-aspect <= 1 <= max-aspect")
        side = self.side
        given = f"resolution {self.resolution:g} ({self.resolution_type.value})"
        if not math.isfinite(side):
            raise InputError(f"{given} is not a finite number")
        if side < self.alignment:
            raise InputError(f"{given} is below the alignment {self.alignment}")
        longest = side * max(self.max_aspect, 1 / self.min_aspect)
        if longest > MAX_SIDE:  # a table of sides up to 1e9 px took gigabytes and never ended
            raise InputError(
                f"{given} with aspect ratios from {self.min_aspect:g} to {self.max_aspect:g} makes bucket sides up "
                f"to {longest:.3g} px; stk makes sides up to {MAX_SIDE} px, far above what any model trains at"
            )


def nearest_multiples(value: int, alignment: int) -> tuple[int, int]:
    """The multiples of `alignment` just below and just above `value` (at least `alignment`)."""
    return max(alignment, value // alignment * alignment), max(alignment, -(-value // alignment) * alignment)


def nearest_aligned(width: int, height: int, alignment: int) -> str:
    """The sizes nearest width x height whose sides are multiples of `alignment`, for an error message:
    "992x992 or 1008x1008" (each side rounded down, then up)."""
    (w_down, w_up), (h_down, h_up) = nearest_multiples(width, alignment), nearest_multiples(height, alignment)
    return " or ".join(f"{w}x{h}" for w, h in dict.fromkeys([(w_down, h_down), (w_up, h_up)]))


def _align(value: float, alignment: int) -> int:
    return max(alignment, round(value / alignment) * alignment)


def make_buckets(spec: BucketSpec) -> list[Bucket]:
    """All buckets for `spec`, ordered by aspect ratio (tallest first), ids 0..n-1."""
    spec.validate()
    a = spec.alignment
    sizes: set[tuple[int, int]] = set()
    if spec.aspect is Aspect.SQUARE:
        sizes.add((_align(spec.side, a), _align(spec.side, a)))
    elif spec.resolution_type is ResolutionType.PIXEL:
        short = _align(spec.resolution, a)
        for long in range(short, int(short * max(spec.max_aspect, 1 / spec.min_aspect)) + 1, a):
            if long / short <= spec.max_aspect + 1e-9:
                sizes.add((long, short))
            if short / long >= spec.min_aspect - 1e-9:
                sizes.add((short, long))
    else:
        area = spec.resolution * 1e6
        square = _align(spec.side, a)
        sizes.add((square, square))
        for width in range(square + a, int(math.sqrt(area * spec.max_aspect)) + 2 * a, a):
            height = _align(area / width, a)
            if width / height <= spec.max_aspect + 1e-9:
                sizes.add((width, height))
        for height in range(square + a, int(math.sqrt(area / spec.min_aspect)) + 2 * a, a):
            width = _align(area / height, a)
            if width / height >= spec.min_aspect - 1e-9:
                sizes.add((width, height))
    ordered = sorted(sizes, key=lambda wh: (wh[0] / wh[1], wh[0]))
    # keep one bucket per aspect ratio (the area rounding can give two sizes for one ratio)
    unique: list[tuple[int, int]] = []
    for wh in ordered:
        if unique and abs(unique[-1][0] / unique[-1][1] - wh[0] / wh[1]) < 1e-12:
            continue
        unique.append(wh)
    return [Bucket(i, w, h) for i, (w, h) in enumerate(unique)]


class BucketIndex:
    """Nearest-bucket lookup by aspect ratio (ties go to the lower id)."""

    def __init__(self, buckets: list[Bucket]) -> None:
        if not buckets:
            raise ValueError("no buckets")
        self.buckets = buckets
        self._logs = [math.log(b.aspect) for b in buckets]

    def nearest(self, width: int, height: int) -> Bucket:
        target = math.log(width / height)
        i = bisect.bisect_left(self._logs, target)
        if i == 0:
            return self.buckets[0]
        if i == len(self.buckets):
            return self.buckets[-1]
        below, above = self._logs[i - 1], self._logs[i]
        return self.buckets[i - 1] if target - below <= above - target else self.buckets[i]


def effective_batch_size(batch_size: int, gpus: int, grad_accum: int) -> int:
    """Samples consumed by one optimizer step across the whole job."""
    if min(batch_size, gpus, grad_accum) < 1:
        raise ValueError("batch size, GPU count and gradient accumulation must be at least 1")
    return batch_size * gpus * grad_accum


@dataclass(frozen=True)
class ShortBucket:
    bucket: Bucket
    count: int  # images in the bucket
    samples: int  # images x repeats
    min_repeats: int  # the smallest repeats that fill one effective batch


@dataclass
class BatchCheck:
    effective_batch_size: int
    repeats: int
    short: list[ShortBucket] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.short

    def repeats_for(self, bucket_id: int, oversubscribe: bool) -> int:
        """Repeats to record for a bucket: raised to its minimum only when oversubscribing."""
        if oversubscribe:
            for s in self.short:
                if s.bucket.id == bucket_id:
                    return s.min_repeats
        return self.repeats

    def message(self) -> str:
        return "\n".join([*self.short_lines(), ways_out(datasets=False)])

    def short_lines(self, dataset: str | None = None) -> list[str]:
        """The short buckets; of one `dataset` of several, named, with its own repeats."""
        given = f"in dataset {dataset!r} with repeats" if dataset else "with --repeats"
        lines = [
            f"{len(self.short)} bucket(s) hold fewer samples than the effective batch size "
            f"{self.effective_batch_size} (batch size x GPUs x gradient accumulation), {given} {self.repeats}:"
        ]
        for s in self.short:
            lines.append(
                f"  bucket {s.bucket.id} ({s.bucket.width}x{s.bucket.height}): {s.count} images, "
                f"{s.samples} samples; needs {'repeats' if dataset else '--repeats'} >= {s.min_repeats}"
            )
        return lines


def ways_out(datasets: bool) -> str:
    """What to change when buckets are short (the last line of a failed batch check)."""
    return (
        "Ways out: --allow-oversubscription (applies those repeats to the short buckets), a smaller "
        f"--batch-size or --grad-accum, more images{', higher repeats' if datasets else ''}, or a wider "
        "--alignment / narrower aspect range so that fewer, fuller buckets are made."
    )


def check_batches(counts: dict[int, int], buckets: list[Bucket], effective: int, repeats: int = 1) -> BatchCheck:
    """Every non-empty bucket must yield at least one effective batch (counting repeats)."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    check = BatchCheck(effective, repeats)
    for bucket in buckets:
        count = counts.get(bucket.id, 0)
        if 0 < count * repeats < effective:
            check.short.append(ShortBucket(bucket, count, count * repeats, math.ceil(effective / count)))
    return check
