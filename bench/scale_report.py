"""bench/scale.py's report: the measurements at each size, each stage's growth and its linear extrapolation to 100M
images (on the measured ranks, and over 32 ranks), and the targets of the scale work with PASS/FAIL."""

from __future__ import annotations

from dataclasses import dataclass

TARGET_IMAGES, TARGET_RANKS = 100_000_000, 32
TABLE_VS_FLOOR = 3.0  # stk-scan of a table with sizes against reading it and stat-ing every path on 8 threads
TABLE_RANK0_BYTES, AT_IMAGES = 1e9, 1_000_000  # rank 0's peak RSS when scanning a 1M-row table
BYTES_PER_IMAGE = 400.0  # any stage, any rank
LISTING_SPEEDUP = 4.0  # S3 listing on 2 ranks x 8 threads against one sequential lister
LINEAR_SLACK = 1.1  # growth from the smaller size to the larger: at most the size ratio, with 10% for noise
NOTES = {
    "table": "stk-scan TABLE (with sizes), 1 rank",
    "nocap": "stk-scan TABLE (with sizes, no caption column: sidecars looked for), 1 rank",
    "dir": "stk-scan DIR",
    "s3": "stk-scan s3://BUCKET, its listing as the command does it now",
    "cache": "stk-cache up to its plan, 1 rank (its planning needs a model now: the tiny one's load is in the time)",
    "train": "stk-train up to its setup, 1 step's peak",
}


@dataclass
class Row:
    """One stage at one size: seconds as the report judges them (the command's own work where it says so), each
    rank's peak RSS, the floor's seconds (its work only) and peak, and for S3 the listing's seconds."""

    stage: str
    images: int
    ranks: int
    wall: float
    peaks: dict[int, int]
    work: float | None = None  # the command's own timing (stk-scan's summary: without start-up and imports)
    floor: float | None = None
    floor_peak: int | None = None
    listing: float | None = None

    @property
    def seconds(self) -> float:
        """What growth and projections extend: the command's own seconds where it reports them, else the wall."""
        return self.wall if self.work is None else self.work


def _mb(value: float) -> str:
    return f"{value / 1e6:,.0f}"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _opt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def measurements(rows: list[Row]) -> None:
    print(
        f"\n{'stage':<6} {'images':>11} {'ranks':>5} {'wall s':>8} {'work s':>8} {'floor s':>8} {'list s':>7}  "
        f"{'peak RSS MB by rank':<22} {'peak/N B':>9}  what"
    )
    for r in rows:
        peaks = " ".join(f"r{rank} {_mb(value)}" for rank, value in sorted(r.peaks.items()))
        print(
            f"{r.stage:<6} {r.images:>11,} {r.ranks:>5} {r.wall:>8.2f} {_opt(r.work, '8.2f'):>8} "
            f"{_opt(r.floor, '8.2f'):>8} {_opt(r.listing, '7.2f'):>7}  {peaks:<22} "
            f"{max(r.peaks.values()) / r.images:>9,.0f}  {NOTES[r.stage]}"
        )
    floors = [r for r in rows if r.floor_peak]
    for r in floors:
        kind = "sequential ListObjectsV2" if r.stage == "s3" else "read + stat on 8 threads, the second run"
        print(f"  floor of {r.stage} at {r.images:,}: {kind}, {r.floor:.2f} s, peak RSS {_mb(r.floor_peak or 0)} MB")


def _slope(small: float, large: float, s: int, n: int) -> float:
    return (large - small) / (n - s)


def projections(pairs: list[tuple[Row, Row]]) -> None:
    """Per stage, from the smaller size to the larger: bytes per image on each rank, and the 100M extrapolations."""
    print(
        f"\ngrowth and projection ({TARGET_IMAGES:,} images: linear from the two sizes; over {TARGET_RANKS} ranks: "
        "if each rank's time and memory follow its share of the images; time: 'work s' where there is one, else "
        "'wall s')"
    )
    print(
        f"{'stage':<6} {'B/image by rank':<24} {'time x':>7} {'peak x':>7} {'size x':>7} "
        f"{'100M s':>9} {'100M GB by rank':<22} {'/32 s':>8} {'/32 GB, largest rank':>21}"
    )
    for s, n in pairs:
        span, target = n.images - s.images, TARGET_IMAGES
        time_slope = (n.seconds - s.seconds) / span
        slopes = {r: _slope(s.peaks.get(r, 0), n.peaks[r], s.images, n.images) for r in n.peaks}
        at_100m = {r: n.peaks[r] + slopes[r] * (target - n.images) for r in n.peaks}
        share, per_rank = target / TARGET_RANKS, n.images / n.ranks
        over_32 = max(n.peaks[r] + slopes[r] * n.ranks * (share - per_rank) for r in n.peaks)
        print(
            f"{n.stage:<6} {' '.join(f'r{r} {v:,.0f}' for r, v in sorted(slopes.items())):<24} "
            f"{n.seconds / s.seconds:>7.2f} {max(n.peaks.values()) / max(s.peaks.values()):>7.2f} "
            f"{n.images / s.images:>7.2f} {n.seconds + time_slope * (target - n.images):>9,.0f} "
            f"{' '.join(f'r{r} {v / 1e9:,.1f}' for r, v in sorted(at_100m.items())):<22} "
            f"{n.seconds + time_slope * n.ranks * (share - per_rank):>8,.0f} {over_32 / 1e9:>21,.1f}"
        )


def targets(rows: list[Row], pairs: list[tuple[Row, Row]]) -> None:
    print("\ntargets (the issue's sizes are 1M and 10M; at other sizes they are a shape check):")
    for r in (r for r in rows if r.stage in ("table", "nocap") and r.floor):
        ratio = r.seconds / (r.floor or 1)
        print(
            f"  {r.stage} scan / read+stat floor at {r.images:>11,}: {ratio:6.2f}x  target <= {TABLE_VS_FLOOR:g}x  "
            f"{_verdict(ratio <= TABLE_VS_FLOOR)}"
        )
    for s, n in (p for p in pairs if p[0].stage == "table"):
        measured = next((r for r in rows if r.stage == "table" and r.images == AT_IMAGES), None)
        if measured is not None:
            peak, how = measured.peaks.get(0, 0), "measured"
        else:
            slope = _slope(s.peaks.get(0, 0), n.peaks.get(0, 0), s.images, n.images)
            peak, how = n.peaks.get(0, 0) + slope * (AT_IMAGES - n.images), f"extrapolated from {n.images:,}"
        print(
            f"  table scan rank-0 peak RSS at {AT_IMAGES:,} ({how}): {peak / 1e9:.2f} GB  target <= "
            f"{TABLE_RANK0_BYTES / 1e9:g} GB  {_verdict(peak <= TABLE_RANK0_BYTES)}"
        )
    for s, n in pairs:
        worst = max(_slope(s.peaks.get(r, 0), n.peaks[r], s.images, n.images) for r in n.peaks)
        size_x = n.images / s.images
        time_x, peak_x = n.seconds / s.seconds, max(n.peaks.values()) / max(s.peaks.values())
        linear = time_x <= size_x * LINEAR_SLACK and peak_x <= size_x * LINEAR_SLACK
        print(
            f"  {n.stage:<6} bytes per image, worst rank: {worst:>8,.0f}  target <= {BYTES_PER_IMAGE:g}  "
            f"{_verdict(worst <= BYTES_PER_IMAGE)};  growth {s.images:,} -> {n.images:,}: "
            f"time {time_x:.2f}x, peak {peak_x:.2f}x for {size_x:g}x images  {_verdict(linear)}"
        )
    for r in (r for r in rows if r.stage == "s3" and r.listing):
        speedup = (r.floor or 0) / max(r.listing or 0, 1e-3)
        print(
            f"  s3 listing, {r.ranks} ranks, vs one sequential lister at {r.images:>9,}: {speedup:6.2f}x  "
            f"target >= {LISTING_SPEEDUP:g}x  {_verdict(speedup >= LISTING_SPEEDUP)}"
        )


def report(rows: list[Row]) -> None:
    """Everything measured, then growth, projections and targets from each stage's smallest size to its largest."""
    measurements(rows)
    print("  'work s': stk-scan's own seconds (its summary); 'list s': from their start to its 'N images listed' line")
    pairs = []
    for stage in NOTES:
        measured = sorted((r for r in rows if r.stage == stage), key=lambda r: r.images)
        if len(measured) > 1:
            pairs.append((measured[0], measured[-1]))
    if pairs:
        projections(pairs)
    targets(rows, pairs)
