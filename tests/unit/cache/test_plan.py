"""Keys and work planning for stk-cache: pure functions; token counts with a tiny model's real tokenizers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from stk.cache.plan import (
    Captions,
    Share,
    assign,
    batch_bounds,
    batch_sums,
    captions_at,
    distinct_captions,
    latent_batches,
    owned,
    rank_share,
    text_batches,
    text_costs,
    token_counts,
)
from stk.errors import InputError
from stk.metadata import write_parquet
from stk.models import Family, build_tiny_model, load_encoders
from stk.models.latents import LatentNorm
from stk.scan.outputs import METADATA
from stk.shards.config import CacheConfig, EncodeSettings
from stk.shards.jobs import ImageJob, ImageJobs, ScanRows, job_columns, read_keys
from stk.shards.keys import latent_key, text_key

ROW = {"path": "a/b.jpg", "bytes": 1000, "mtime": 1.5, "bucket_width": 64, "bucket_height": 48, "caption": "a cat"}
RECIPE = {"model": "abc", "latents": {"crop": "center"}}


def test_latent_key_changes_with_identity_bucket_and_recipe() -> None:
    base = latent_key(ROW, RECIPE)
    assert base == latent_key(dict(ROW), dict(RECIPE))
    for change in ({"mtime": 2.0}, {"bytes": 1001}, {"path": "a/c.jpg"}, {"bucket_width": 48}):
        assert latent_key({**ROW, **change}, RECIPE) != base, change
    assert latent_key(ROW, {**RECIPE, "model": "abd"}) != base


def test_one_text_key_per_caption_and_encoder() -> None:
    # the key is the caption and recipe as canonical JSON (keys sorted), so a cache written earlier keeps its keys
    canonical = b'["a cat",{"latents":{"crop":"center"},"model":"abc"}]'
    assert text_key("a cat", RECIPE) == hashlib.sha256(canonical).hexdigest()[:40]
    assert text_key("a cat", dict(reversed(RECIPE.items()))) == text_key("a cat", RECIPE)
    assert text_key("a cat", RECIPE) != text_key("a dog", RECIPE)
    assert text_key("a cat", RECIPE) != text_key("a cat", {"model": "other"})


def _rows(n: int) -> list[dict[str, object]]:
    return [
        {**ROW, "path": f"img{i:03d}.jpg", "bucket_width": 64 if i % 3 else 48, "caption": f"c{i % 4}"}
        for i in range(n)
    ]


def _columns(rows: list[dict[str, object]], root: str = "/data") -> ImageJobs:
    return job_columns(pa.Table.from_pylist(rows), root, RECIPE, RECIPE)


def test_jobs_locate_images_under_the_scan_root_and_share_caption_keys() -> None:
    jobs = _columns(_rows(12)).rows()
    assert jobs[0].location == "/data/img000.jpg"
    assert len({j.text_key for j in jobs}) == 4
    assert _columns([ROW], "").rows()[0].location == "a/b.jpg"
    for job, row in zip(jobs, _rows(12), strict=True):  # the columns key every row as latent_key does
        assert (job.key, job.text_key) == (latent_key(row, RECIPE), text_key(str(row["caption"]), RECIPE))
    assert _columns([{**ROW, "caption": None}], "").rows()[0].caption == ""


def _scan(where: Path, rows: list[dict[str, object]]) -> ScanRows:
    """A scan table of these rows, opened as stk-cache reads it (a batch of rows at a time)."""
    where.mkdir(parents=True, exist_ok=True)
    write_parquet(pa.Table.from_pylist(rows), str(where / METADATA))
    return ScanRows(str(where))


def _latent_share(where: Path, rows: list[dict[str, object]], batch_size: int) -> list[list[ImageJob]]:
    order, bounds = latent_batches(read_keys(_scan(where, rows), RECIPE, RECIPE)[0], batch_size)
    return list(Share(_columns(rows).take(order), bounds).batches())


def test_latent_batches_hold_one_bucket_and_do_not_depend_on_input_order(tmp_path: Path) -> None:
    rows = _rows(25)
    batches = _latent_share(tmp_path / "sorted", rows, 4)
    assert sum(len(b) for b in batches) == 25
    assert all(len({(j.bucket_width, j.bucket_height) for j in b}) == 1 for b in batches)
    assert all(len(b) <= 4 for b in batches)
    assert [len(b) for b in batches] == [4, 4, 1, 4, 4, 4, 4]  # 9 images of 48x48, then 16 of 64x48
    reordered = _latent_share(tmp_path / "reversed", list(reversed(rows)), 4)  # a table not in path order
    assert [[j.key for j in b] for b in reordered] == [[j.key for j in b] for b in batches]


def test_plan_on_keys_matches_sorting_the_table_by_bucket_and_path(tmp_path: Path) -> None:
    # the order and captions a plan made from the whole table's strings (bucket, then path; the first row of each
    # caption) come out the same from keys and integers, for a table in path order or not, across batches of rows
    random = np.random.default_rng(0)
    rows = [
        {
            **ROW,
            "path": f"d{i % 7}/{i:05d}.jpg",
            "bucket_width": int(random.choice([32, 48, 64])),
            "bucket_height": int(random.choice([32, 64])),
            "caption": f"c{random.integers(50)}",
        }
        for i in range(3000)
    ]
    for name, table in (("sorted", sorted(rows, key=lambda r: str(r["path"]))), ("shuffled", rows)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("stk.shards.jobs._KEY_CHUNK", 2999)  # the last batch one row
            keys, _, texts = read_keys(_scan(tmp_path / name, table), RECIPE, RECIPE)
        whole = pa.Table.from_pylist(table)
        wanted = pc.sort_indices(
            whole, [("bucket_height", "ascending"), ("bucket_width", "ascending"), ("path", "ascending")]
        ).to_numpy()
        assert latent_batches(keys, 16)[0].tolist() == wanted.tolist(), name
        assert (keys.path_rank is None) == (name == "sorted")
        captions = distinct_captions(texts, ["", "c3"], RECIPE)
        first = {}
        for row, caption in enumerate(whole.column("caption").to_pylist()):
            first.setdefault(text_key(caption, RECIPE).encode(), row)
        first.setdefault(text_key("", RECIPE).encode(), -1)
        assert dict(zip(captions.key.tolist(), captions.source.tolist(), strict=True)) == first, name


def test_batch_bounds_cut_each_group_into_batches() -> None:
    assert batch_bounds(np.array([1, 1, 1, 2, 2, 3]), 2).tolist() == [0, 2, 3, 5, 6]
    assert batch_bounds(np.array([], np.int64), 2).tolist() == [0]
    assert batch_sums(np.array([1, 2, 3, 4, 5, 6]), np.array([0, 2, 3, 5, 6])).tolist() == [3, 3, 9, 6]


def _text_share(keys: list[str], tokens: list[int], batch_size: int) -> list[list[str]]:
    key_array = np.array(keys, "S40")
    order, bounds = text_batches(key_array, np.array(tokens, np.int32), batch_size)
    captions = Captions(key_array, np.arange(len(keys)), [], pa.array(keys)).take(order)
    return [[k for k, _ in batch] for batch in Share(captions, bounds).batches()]


def test_text_batches_are_sorted_by_key() -> None:
    assert _text_share(["k3", "k1", "k2"], [0, 0, 0], 2) == [["k1", "k2"], ["k3"]]


def test_text_batches_group_captions_of_similar_token_counts_whatever_the_input_order() -> None:
    counts = [30, 2, 31, 3, 29, 1, 2, 30]
    keys = [f"k{i:02d}" for i in range(len(counts))]
    tokens = dict(zip(keys, counts, strict=True))
    batches = _text_share(keys, counts, 4)
    assert [[tokens[k] for k in b] for b in batches] == [[1, 2, 2, 3], [29, 30, 30, 31]]
    assert _text_share(keys[::-1], counts[::-1], 4) == batches  # the rank count cannot change it
    assert [len(b) for b in _text_share(keys, counts, 3)] == [3, 3, 2]  # --text-batch-size: captions a batch
    # ranks share batches by what a padded batch runs: its captions times its longest caption's tokens
    in_order = np.array([tokens[k] for b in batches for k in b], np.int32)
    assert text_costs(in_order, np.array([0, 4, 8])).tolist() == [4 * 3, 4 * 31]
    assert text_costs(np.array([0], np.int32), np.array([0, 1])).tolist() == [1]


def test_distinct_captions_hold_the_extra_ones_once(tmp_path: Path) -> None:
    scan = _scan(tmp_path, _rows(12))
    captions = distinct_captions(read_keys(scan, RECIPE, RECIPE)[2], ["", "c1", "a prompt"], RECIPE)
    again = captions_at(scan, captions.extra, captions.source, RECIPE)  # what a rank rebuilds from sources
    texts = again.texts(0, len(again))
    assert sorted(texts) == ["", "a prompt", "c0", "c1", "c2", "c3"]
    assert captions.key.tolist() == again.key.tolist() == sorted(text_key(c, RECIPE).encode() for c in texts)
    assert captions.source[texts.index("c1")] >= 0  # scanned and extra: the scanned one


def test_token_counts_are_the_longest_over_the_family_tokenizers_capped_at_their_length(tmp_path: Path) -> None:
    encoders = load_encoders(build_tiny_model(Family.FLUX, str(tmp_path / "flux")), Family.FLUX, "cpu")  # CLIP + T5
    clip, t5 = encoders.text
    captions = ["a cat", "a photo of " * 200, ""]
    table = [{**ROW, "path": f"{i}.jpg", "caption": c} for i, c in enumerate(["a cat", None, "a photo of " * 200])]
    short, long, empty, extra = token_counts(  # scanned rows read a batch at a time, and an extra caption
        encoders.text, Captions(np.zeros(4, "S1"), np.array([0, 2, 1, -1]), ["a cat"]), _scan(tmp_path / "s", table)
    ).tolist()
    assert extra == short
    assert long == max(clip.max_length, t5.max_length)  # truncated as the encoder reads it
    for count, caption in zip((short, long, empty), captions, strict=True):
        lengths = [len(e.tokenizer(caption, truncation=True, max_length=e.max_length)["input_ids"]) for e in (clip, t5)]
        assert count == max(lengths), caption
    assert empty < short < long


def test_owned_takes_whole_batches_in_batch_order() -> None:
    order = np.array([5, 4, 3, 2, 1, 0])
    items, bounds = owned(order, np.array([0, 2, 3, 6]), [0, 2])
    assert items.tolist() == [5, 4, 2, 1, 0] and bounds.tolist() == [0, 2, 5]


def test_assign_balances_cost_and_covers_every_batch_once() -> None:
    costs = [10, 10, 10, 10, 5, 5, 3, 1]
    owners = assign(costs, 2)
    assert sorted(i for o in owners for i in o) == list(range(len(costs)))
    loads = [sum(costs[i] for i in o) for o in owners]
    assert abs(loads[0] - loads[1]) <= 2
    assert assign(costs, 1) == [list(range(len(costs)))]
    assert assign([], 3) == [[], [], []]


def test_a_rank_reads_its_rows_and_refuses_a_table_that_changed(tmp_path: Path) -> None:
    rows = _rows(6)
    write_parquet(pa.Table.from_pylist(rows), str(tmp_path / METADATA))
    config = CacheConfig("sd", {"vae": "x", "text": "y"}, EncodeSettings(), {}, LatentNorm(0.18215))
    share = (np.array([4, 1]), np.array([0, 2]), np.array([3, -1]), np.array([0, 2]))
    latent, text = rank_share(str(tmp_path), config, 6, ["a prompt"], share)
    jobs = next(latent.batches())
    assert [j.path for j in jobs] == ["img004.jpg", "img001.jpg"]
    assert [j.key for j in jobs] == [latent_key(rows[i], config.latent_recipe()) for i in (4, 1)]
    assert next(text.batches()) == [(text_key(c, config.text_recipe()), c) for c in ("c3", "a prompt")]
    with pytest.raises(InputError, match="changed while stk-cache read it"):
        rank_share(str(tmp_path), config, 7, [], share)
