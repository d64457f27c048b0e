"""Unit tests for stk.buckets: the bucket table, nearest-bucket lookup and the batch check."""

from __future__ import annotations

import itertools
import math

import pytest

from stk.buckets import (
    MAX_SIDE,
    Aspect,
    BatchCheck,
    Bucket,
    BucketIndex,
    BucketSpec,
    ResolutionType,
    ShortBucket,
    check_batches,
    effective_batch_size,
    make_buckets,
    nearest_aligned,
    nearest_multiples,
)
from stk.errors import InputError

PIXEL_SPECS = [
    BucketSpec(1024, ResolutionType.PIXEL, 64, 0.5, 2.0),
    BucketSpec(1024, ResolutionType.PIXEL, 16, 0.5, 2.0),
    BucketSpec(512, ResolutionType.PIXEL, 64, 0.75, 1.34),
    BucketSpec(1000, ResolutionType.PIXEL, 64, 0.5, 2.0),  # not a multiple of the alignment
]
AREA_SPECS = [
    BucketSpec(1.0, ResolutionType.AREA, 64, 0.5, 2.0),
    BucketSpec(1.048576, ResolutionType.AREA, 16, 0.5, 2.0),
    BucketSpec(0.25, ResolutionType.AREA, 64, 0.75, 1.34),
]


def _ids(spec: BucketSpec) -> str:
    return f"{spec.resolution_type.value}-{spec.resolution}-a{spec.alignment}-{spec.min_aspect}-{spec.max_aspect}"


# --- make_buckets ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", PIXEL_SPECS + AREA_SPECS, ids=_ids)
def test_every_side_is_a_multiple_of_the_alignment(spec: BucketSpec) -> None:
    buckets = make_buckets(spec)
    assert buckets
    for b in buckets:
        assert b.width % spec.alignment == 0, b
        assert b.height % spec.alignment == 0, b
        assert b.width >= spec.alignment and b.height >= spec.alignment


@pytest.mark.parametrize("spec", PIXEL_SPECS + AREA_SPECS, ids=_ids)
def test_aspect_range_is_respected(spec: BucketSpec) -> None:
    buckets = make_buckets(spec)
    assert len(buckets) > 1  # a range of aspects holds more than the square
    for b in buckets:
        assert spec.min_aspect - 1e-9 <= b.aspect <= spec.max_aspect + 1e-9, b


@pytest.mark.parametrize("spec", PIXEL_SPECS + AREA_SPECS, ids=_ids)
def test_ids_are_consecutive_and_ordered_by_aspect(spec: BucketSpec) -> None:
    buckets = make_buckets(spec)
    assert [b.id for b in buckets] == list(range(len(buckets)))
    aspects = [b.aspect for b in buckets]
    # strictly increasing: tallest first, and one bucket per aspect ratio
    assert all(a < b for a, b in itertools.pairwise(aspects)), aspects


@pytest.mark.parametrize("spec", PIXEL_SPECS, ids=_ids)
def test_pixel_buckets_share_the_aligned_short_edge(spec: BucketSpec) -> None:
    buckets = make_buckets(spec)
    short = {min(b.width, b.height) for b in buckets}
    assert len(short) == 1
    (edge,) = short
    assert edge % spec.alignment == 0
    assert abs(edge - spec.resolution) <= spec.alignment / 2
    # the square is always there, and both orientations of every other size
    sizes = {(b.width, b.height) for b in buckets}
    assert (edge, edge) in sizes
    assert all((h, w) in sizes for w, h in sizes)


def test_pixel_default_table() -> None:
    buckets = make_buckets(BucketSpec())
    # long side 1024..2048 in steps of 64 in both orientations, the square once
    assert len(buckets) == 2 * 17 - 1
    assert (buckets[0].width, buckets[0].height) == (1024, 2048)
    assert (buckets[-1].width, buckets[-1].height) == (2048, 1024)
    assert (buckets[16].width, buckets[16].height) == (1024, 1024)


def test_pixel_alignment_16_has_finer_steps() -> None:
    coarse = make_buckets(BucketSpec(1024, alignment=64))
    fine = make_buckets(BucketSpec(1024, alignment=16))
    assert len(fine) == 2 * 65 - 1
    assert {(b.width, b.height) for b in coarse} < {(b.width, b.height) for b in fine}
    longs = sorted({max(b.width, b.height) for b in fine})
    assert longs == list(range(1024, 2048 + 1, 16))


def test_narrow_aspect_range_gives_few_buckets() -> None:
    buckets = make_buckets(BucketSpec(512, min_aspect=0.75, max_aspect=1.34))
    assert [(b.width, b.height) for b in buckets] == [(512, 640), (512, 576), (512, 512), (576, 512), (640, 512)]


@pytest.mark.parametrize("spec", AREA_SPECS, ids=_ids)
def test_area_buckets_hold_about_the_requested_area(spec: BucketSpec) -> None:
    area = spec.resolution * 1e6
    buckets = make_buckets(spec)
    assert len(buckets) >= 3
    for b in buckets:
        # the short side is area / long side rounded to the alignment (off by alignment/2 rows);
        # the square has both sides rounded (off by about side x alignment)
        tolerance = max(b.width, b.height) * spec.alignment / (1 if b.width == b.height else 2)
        assert abs(b.width * b.height - area) <= tolerance + 1e-6, b
    assert any(b.aspect < 1 for b in buckets) and any(b.aspect > 1 for b in buckets)
    # symmetric, with a square bucket: a portrait for every landscape
    sizes = {(b.width, b.height) for b in buckets}
    assert sizes == {(h, w) for w, h in sizes}
    assert any(b.width == b.height for b in buckets)


def test_area_of_1024_squared_includes_the_square() -> None:
    buckets = make_buckets(BucketSpec(1.048576, ResolutionType.AREA, 64))
    assert (1024, 1024) in {(b.width, b.height) for b in buckets}


def test_area_alignment_16_is_finer_than_64() -> None:
    coarse = make_buckets(BucketSpec(1.0, ResolutionType.AREA, 64))
    fine = make_buckets(BucketSpec(1.0, ResolutionType.AREA, 16))
    assert len(fine) > len(coarse)
    assert all(b.width % 16 == 0 and b.height % 16 == 0 for b in fine)
    assert any(b.width % 64 or b.height % 64 for b in fine)


# --- BucketSpec.validate ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (BucketSpec(alignment=0), "alignment"),
        (BucketSpec(alignment=-16), "alignment"),
        (BucketSpec(min_aspect=0.0), "aspect range"),
        (BucketSpec(min_aspect=-0.5), "aspect range"),
        (BucketSpec(min_aspect=1.5, max_aspect=2.0), "aspect range"),
        (BucketSpec(min_aspect=0.5, max_aspect=0.9), "aspect range"),
        (BucketSpec(resolution=32, alignment=64), "below the alignment"),
        (BucketSpec(resolution=0.001, resolution_type=ResolutionType.AREA, alignment=64), "below the alignment"),
        (
            BucketSpec(resolution=1e9),
            r"^resolution 1e\+09 \(pixel\) with aspect ratios from 0.5 to 2 makes bucket "
            r"sides up to 2e\+09 px; stk makes sides up to 65536 px",
        ),
        (BucketSpec(resolution=1e9, resolution_type=ResolutionType.AREA), "sides up to 6.32e\\+07 px"),
        (BucketSpec(resolution=1024, min_aspect=1e-9), "sides up to 1.02e\\+12 px"),
        (BucketSpec(resolution=float("nan")), "resolution nan"),
    ],
)
def test_validate_rejects_bad_specs(spec: BucketSpec, message: str) -> None:
    with pytest.raises(InputError, match=message):
        spec.validate()
    with pytest.raises(InputError, match=message):
        make_buckets(spec)


def test_validate_accepts_edges() -> None:
    BucketSpec(64, alignment=64, min_aspect=1.0, max_aspect=1.0).validate()
    largest = make_buckets(BucketSpec(MAX_SIDE / 2, alignment=8))  # the most sides a spec may ask for
    assert max(max(b.width, b.height) for b in largest) == MAX_SIDE
    only_square = make_buckets(BucketSpec(64, alignment=64, min_aspect=1.0, max_aspect=1.0))
    assert [(b.width, b.height) for b in only_square] == [(64, 64)]


@pytest.mark.parametrize(
    ("spec", "side"),
    [
        (BucketSpec(1000, ResolutionType.PIXEL, 64, aspect=Aspect.SQUARE), 1024),  # the short edge, aligned
        (BucketSpec(1.0, ResolutionType.AREA, 64, aspect=Aspect.SQUARE), 1024),  # the square of that area
        (BucketSpec(1024 * 1024 / 1e6, ResolutionType.AREA, 16, aspect=Aspect.SQUARE), 1024),
    ],
)
def test_square_is_one_bucket_that_every_aspect_goes_to(spec: BucketSpec, side: int) -> None:
    buckets = make_buckets(spec)
    assert [(b.id, b.width, b.height) for b in buckets] == [(0, side, side)]
    assert BucketIndex(buckets).nearest(3000, 1000).id == 0  # SimpleTuner's crop_aspect square: cropped square


# --- BucketIndex.nearest -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_index() -> BucketIndex:
    return BucketIndex(make_buckets(BucketSpec()))


@pytest.mark.parametrize("side", [1, 64, 1000, 1024, 4096, 50_000])
def test_square_goes_to_the_square_bucket(default_index: BucketIndex, side: int) -> None:
    b = default_index.nearest(side, side)
    assert (b.width, b.height) == (1024, 1024)


@pytest.mark.parametrize(("width", "height"), [(10_000, 1), (5000, 2000), (2049, 1024)])
def test_extreme_landscape_goes_to_the_widest_bucket(default_index: BucketIndex, width: int, height: int) -> None:
    assert default_index.nearest(width, height) is default_index.buckets[-1]
    assert (default_index.buckets[-1].width, default_index.buckets[-1].height) == (2048, 1024)


@pytest.mark.parametrize(("width", "height"), [(1, 10_000), (2000, 5000), (1024, 2049)])
def test_extreme_portrait_goes_to_the_tallest_bucket(default_index: BucketIndex, width: int, height: int) -> None:
    assert default_index.nearest(width, height) is default_index.buckets[0]


def test_nearest_picks_the_closest_aspect(default_index: BucketIndex) -> None:
    # 16:9 = 1.777...: closest in log space among long sides k*64 over 1024 is 1792x1024 (1.75)
    b = default_index.nearest(1920, 1080)
    assert (b.width, b.height) == (1792, 1024)
    assert (default_index.nearest(1080, 1920).width, default_index.nearest(1080, 1920).height) == (1024, 1792)
    # an exact match wins
    assert (default_index.nearest(1536, 1024).width, default_index.nearest(1536, 1024).height) == (1536, 1024)
    # brute force agrees on a range of sizes
    for w in range(300, 2400, 97):
        for h in (500, 777, 1024, 1300):
            best = min(default_index.buckets, key=lambda bk: (abs(math.log(w / h) - math.log(bk.aspect)), bk.id))
            assert default_index.nearest(w, h).id == best.id, (w, h)


def test_ties_go_to_the_lower_id() -> None:
    # 1:2 and 2:1 are equally far from 1:1 in log space
    index = BucketIndex([Bucket(0, 64, 128), Bucket(1, 128, 64)])
    assert index.nearest(100, 100).id == 0
    # 1:1 and 4:1 are equally far from 2:1
    index = BucketIndex([Bucket(0, 64, 64), Bucket(1, 256, 64)])
    assert index.nearest(200, 100).id == 0
    # off the tie, the nearer one wins
    assert index.nearest(201, 100).id == 1


def test_index_needs_buckets() -> None:
    with pytest.raises(ValueError):
        BucketIndex([])


# --- effective_batch_size ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "batch", "accum", "expected"),
    [(1, 4, 1, 32), (2, 8, 2, 256), (4, 8, 1, 256)],
)
def test_effective_batch_size(nodes: int, batch: int, accum: int, expected: int) -> None:
    gpus = nodes * 8
    assert effective_batch_size(batch, gpus, accum) == expected


@pytest.mark.parametrize(
    ("batch", "gpus", "accum"), [(0, 8, 1), (4, 0, 1), (4, 8, 0), (-1, 8, 1), (4, -8, 1), (4, 8, -2)]
)
def test_effective_batch_size_rejects_values_below_one(batch: int, gpus: int, accum: int) -> None:
    with pytest.raises(ValueError):
        effective_batch_size(batch, gpus, accum)


# --- check_batches / BatchCheck --------------------------------------------------------------------


@pytest.fixture(scope="module")
def buckets() -> list[Bucket]:
    return make_buckets(BucketSpec(512, min_aspect=0.75, max_aspect=1.34))  # 5 buckets, ids 0..4


def test_short_buckets_are_listed_with_count_samples_and_min_repeats(buckets: list[Bucket]) -> None:
    check = check_batches({0: 3, 2: 100, 4: 31}, buckets, effective=32)
    assert not check.ok
    assert check.effective_batch_size == 32 and check.repeats == 1
    assert [(s.bucket.id, s.count, s.samples, s.min_repeats) for s in check.short] == [(0, 3, 3, 11), (4, 31, 31, 2)]
    assert check.short[0].bucket is buckets[0]


def test_repeats_are_counted(buckets: list[Bucket]) -> None:
    check = check_batches({0: 3, 1: 8, 2: 100}, buckets, effective=32, repeats=4)
    # bucket 1: 8 x 4 = 32 fills one batch exactly; bucket 0: 3 x 4 = 12 does not
    assert [(s.bucket.id, s.count, s.samples, s.min_repeats) for s in check.short] == [(0, 3, 12, 11)]
    assert check.repeats == 4
    assert check_batches({0: 3, 1: 8, 2: 100}, buckets, effective=32, repeats=11).ok


def test_exact_fill_is_not_short(buckets: list[Bucket]) -> None:
    assert check_batches({3: 32}, buckets, effective=32).ok
    check = check_batches({3: 31}, buckets, effective=32)
    assert [(s.bucket.id, s.min_repeats) for s in check.short] == [(3, 2)]


def test_empty_buckets_are_not_short(buckets: list[Bucket]) -> None:
    check = check_batches({0: 0, 2: 64}, buckets, effective=64)
    assert check.ok and check.short == []
    assert check_batches({}, buckets, effective=1000).ok


def test_counts_for_unknown_bucket_ids_are_ignored(buckets: list[Bucket]) -> None:
    assert check_batches({99: 1}, buckets, effective=32).ok


def test_repeats_below_one_are_rejected(buckets: list[Bucket]) -> None:
    with pytest.raises(ValueError):
        check_batches({0: 1}, buckets, effective=1, repeats=0)


def test_message_lists_every_short_bucket_and_the_ways_out(buckets: list[Bucket]) -> None:
    check = check_batches({0: 3, 1: 5, 2: 100, 4: 7}, buckets, effective=32, repeats=2)
    text = check.message()
    lines = text.splitlines()
    assert lines[0].startswith("3 bucket(s)")
    assert "effective batch size 32" in lines[0] and "--repeats 2" in lines[0]
    assert "  bucket 0 (512x640): 3 images, 6 samples; needs --repeats >= 11" in lines
    assert "  bucket 1 (512x576): 5 images, 10 samples; needs --repeats >= 7" in lines
    assert "  bucket 4 (640x512): 7 images, 14 samples; needs --repeats >= 5" in lines
    assert not any("bucket 2 " in line for line in lines)
    for way_out in ("--allow-oversubscription", "--batch-size", "--grad-accum", "more images", "--alignment"):
        assert way_out in lines[-1]


def test_repeats_for_without_oversubscription(buckets: list[Bucket]) -> None:
    check = check_batches({0: 3, 2: 100}, buckets, effective=32, repeats=2)
    assert [check.repeats_for(b.id, oversubscribe=False) for b in buckets] == [2, 2, 2, 2, 2]


def test_repeats_for_with_oversubscription(buckets: list[Bucket]) -> None:
    check = check_batches({0: 3, 2: 100, 4: 20}, buckets, effective=32, repeats=1)
    # short buckets get their minimum; the others (full or empty) keep --repeats
    assert [check.repeats_for(b.id, oversubscribe=True) for b in buckets] == [11, 1, 1, 1, 2]


def test_batch_check_ok_property() -> None:
    bucket = Bucket(0, 64, 64)
    assert BatchCheck(8, 1).ok
    assert not BatchCheck(8, 1, [ShortBucket(bucket, 1, 1, 8)]).ok


@pytest.mark.parametrize(
    ("width", "height", "alignment", "expected"),
    [
        (1000, 1000, 16, "992x992 or 1008x1008"),
        (1000, 1024, 16, "992x1024 or 1008x1024"),
        (8, 100, 16, "16x96 or 16x112"),
    ],
)
def test_nearest_aligned_names_the_sizes_below_and_above(
    width: int, height: int, alignment: int, expected: str
) -> None:
    assert nearest_aligned(width, height, alignment) == expected
    assert nearest_multiples(24, 16) == (16, 32) and nearest_multiples(32, 16) == (32, 32)
