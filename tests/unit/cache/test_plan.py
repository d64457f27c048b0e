"""Keys and work planning for stk-cache: pure functions; token counts with a tiny model's real tokenizers."""

from __future__ import annotations

import hashlib
from pathlib import Path

from stk.cache.plan import assign, latent_batches, text_batches, text_costs, token_counts
from stk.models import Family, build_tiny_model, load_encoders
from stk.scan.reader import ScanTable
from stk.shards.jobs import ImageJob, jobs_for
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


def _jobs(n: int) -> list[ImageJob]:
    rows = [
        {**ROW, "path": f"img{i:03d}.jpg", "bucket_width": 64 if i % 3 else 48, "caption": f"c{i % 4}"}
        for i in range(n)
    ]
    return jobs_for(ScanTable(rows, "/data"), RECIPE, RECIPE)


def test_jobs_locate_images_under_the_scan_root_and_share_caption_keys() -> None:
    jobs = _jobs(12)
    assert jobs[0].location == "/data/img000.jpg"
    assert len({j.text_key for j in jobs}) == 4
    assert jobs_for(ScanTable([ROW], ""), RECIPE, RECIPE)[0].location == "a/b.jpg"


def test_latent_batches_hold_one_bucket_and_do_not_depend_on_input_order() -> None:
    jobs = _jobs(25)
    batches = latent_batches(jobs, 4)
    assert sum(len(b) for b in batches) == 25
    assert all(len({(j.bucket_width, j.bucket_height) for j in b}) == 1 for b in batches)
    assert all(len(b) <= 4 for b in batches)
    reordered = latent_batches(list(reversed(jobs)), 4)
    assert [[j.key for j in b] for b in reordered] == [[j.key for j in b] for b in batches]


def test_text_batches_are_sorted_by_key() -> None:
    batches = text_batches({"k3": "c", "k1": "a", "k2": "b"}, 2)
    assert batches == [[("k1", "a"), ("k2", "b")], [("k3", "c")]]


def test_text_batches_group_captions_of_similar_token_counts_whatever_the_input_order() -> None:
    captions = {f"k{i:02d}": "word " * n for i, n in enumerate([30, 2, 31, 3, 29, 1, 2, 30])}
    tokens = {key: len(caption.split()) for key, caption in captions.items()}
    batches = text_batches(captions, 4, tokens)
    assert [[tokens[k] for k, _ in b] for b in batches] == [[1, 2, 2, 3], [29, 30, 30, 31]]
    assert text_batches(dict(reversed(captions.items())), 4, tokens) == batches  # the rank count cannot change it
    assert [len(b) for b in text_batches(captions, 3, tokens)] == [3, 3, 2]  # --text-batch-size: captions a batch
    # ranks share batches by what a padded batch runs: its captions times its longest caption's tokens
    assert text_costs(batches, tokens) == [4 * 3, 4 * 31]
    assert text_costs([[("none", "")]], {}) == [1]


def test_token_counts_are_the_longest_over_the_family_tokenizers_capped_at_their_length(tmp_path: Path) -> None:
    encoders = load_encoders(build_tiny_model(Family.FLUX, str(tmp_path / "flux")), Family.FLUX, "cpu")  # CLIP + T5
    clip, t5 = encoders.text
    captions = {"short": "a cat", "long": "a photo of " * 200, "empty": ""}
    counts = token_counts(encoders.text, captions)
    assert counts["long"] == max(clip.max_length, t5.max_length)  # truncated as the encoder reads it
    for key, caption in captions.items():
        lengths = [len(e.tokenizer(caption, truncation=True, max_length=e.max_length)["input_ids"]) for e in (clip, t5)]
        assert counts[key] == max(lengths), key
    assert counts["empty"] < counts["short"] < counts["long"]


def test_assign_balances_cost_and_covers_every_batch_once() -> None:
    costs = [10, 10, 10, 10, 5, 5, 3, 1]
    owners = assign(costs, 2)
    assert sorted(i for o in owners for i in o) == list(range(len(costs)))
    loads = [sum(costs[i] for i in o) for o in owners]
    assert abs(loads[0] - loads[1]) <= 2
    assert assign(costs, 1) == [list(range(len(costs)))]
    assert assign([], 3) == [[], [], []]
