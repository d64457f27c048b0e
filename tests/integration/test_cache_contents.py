"""What a cache holds, end to end on tiny random-weight SD, SDXL and Flux models on the CPU: values against a direct
VAE and text-encoder run, deduplicated captions, 1 rank against 2, --trim-padding, and what info reports."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from support.cache_builds import (
    BAD,
    FP32,
    ONE_BAD,
    SHARED_CAPTION,
    Built,
    Scanned,
    assert_same_latents,
    run_cache,
    shard_rows,
)
from support.commands import summary_of

from stk.images.preprocess import CropMode, preprocess
from stk.models import Family, load_encoders
from stk.models.families import spec_for
from stk.prompts import EMPTY_CAPTION
from stk.shards import CacheReader, Manifest
from stk.shards.jobs import ImageJob, read_jobs
from stk.shards.keys import text_key

pytestmark = pytest.mark.integration


FAMILIES = [Family.SD, Family.SDXL, Family.FLUX, Family.ZIMAGE]
# One family per kind of cache: a 4-channel VAE with CLIP (SD, SDXL with its pooled vector and size conditioning), the
# 16-channel VAE with T5 (FLUX.1; SD3.5 and Chroma store the same kinds of arrays), and real tokens with a text mask
# (Z-Image; Chroma's too). Every family's encoders are checked against its pipeline's encode_prompt in
# tests/unit/models, and every family's cache is built by stk-cache and trained on in the ZeRO matrix.
families = pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.value)


def jobs_of(cache: Path | str, scan: Path) -> list[ImageJob]:
    """The scan's rows with the keys the cache's own config gives them (no model needed)."""
    manifest = Manifest.load(str(cache))
    assert manifest is not None
    config = manifest.cache_config(str(cache))
    return read_jobs(str(scan), config.latent_recipe(), config.text_recipe()).rows()


@families
def test_cache_holds_what_the_vae_and_text_encoders_give(
    family: Family, models: dict[Family, str], scanned: Scanned, built: Callable[[Family], Built]
) -> None:
    cache = built(family)
    summary = cache.summary
    assert summary["family"] == family.value and summary["ranks"] == 1
    assert summary["images"] == 41 and summary["encoded_images"] == 40 and summary["reused_images"] == 0
    assert summary["errors"] == 1 and summary["shards_written"] >= 1
    errors = [json.loads(line) for line in (cache.path / "errors.jsonl").read_text().splitlines()]
    assert [(e["path"], e["kind"]) for e in errors] == [(BAD, "decode_failed")]

    verify = run_cache(["verify", cache.path, "--scan", scanned.scan])
    assert verify.returncode == 0, verify.stderr
    report = summary_of(verify)
    assert report == {
        "ok": True,
        "shards": report["shards"],
        "latents": 40,
        "texts": len(scanned.texts),
        "bad_input": 1,
    }

    rows = {row["path"]: row for row in scanned.rows}
    jobs = jobs_of(cache.path, scanned.scan)
    vae = AutoencoderKL.from_pretrained(models[family], subfolder="vae").eval()
    cropped = 0
    with CacheReader(str(cache.path)) as reader:
        assert set(reader.latent_keys()) == {job.key for job in jobs if job.path != BAD}
        for job in jobs:
            if job.path == BAD:
                continue
            sample = reader.latent(job.key)
            assert (sample.path, sample.text_key) == (job.path, job.text_key)
            with open(job.location, "rb") as f:
                pre = preprocess(f, job.bucket_width, job.bucket_height, CropMode.CENTER, job.key)
            with torch.inference_mode():
                dist = vae.encode(torch.from_numpy(pre.pixels)[None]).latent_dist
            expected = dist.mean[0].numpy()
            assert sample.mean.dtype == np.float32
            # the log-variance where the family's example trains on a sample (every family here: SD, SDXL, FLUX.1)
            assert (sample.logvar is not None) is spec_for(family).denoiser.example.samples_latents
            if sample.logvar is not None:
                np.testing.assert_allclose(sample.logvar, dist.logvar[0].numpy(), rtol=1e-4, atol=1e-4)
            assert sample.mean.shape == (
                spec_for(family).tiny.latent_channels,
                job.bucket_height // 8,
                job.bucket_width // 8,
            )
            # unscaled and unshifted; batched vs alone on the CPU differs in the last bits only
            np.testing.assert_allclose(sample.mean, expected, rtol=1e-4, atol=1e-5, err_msg=job.path)
            # the size and crop SDXL conditions on: as preprocess gives them; the size is the scan's (EXIF-oriented)
            assert sample.original_size == pre.original_size == (rows[job.path]["height"], rows[job.path]["width"])
            assert sample.crop_top_left == pre.crop_top_left
            cropped += sample.crop_top_left != (0, 0)
        assert cropped > 0, "no image was cropped: the crop offsets were not tested"

        encoders = load_encoders(models[family], device="cpu")
        captions = {job.text_key: job.caption for job in jobs}
        captions[text_key(EMPTY_CAPTION, reader.manifest.cache_config(reader.cache).text_recipe())] = EMPTY_CAPTION
        assert set(reader.text_keys()) == set(captions)
        for key, caption in captions.items():
            stored = reader.text(key)
            (direct,) = encoders.encode_text([caption])
            assert stored.length == direct.length
            assert sorted(stored.arrays) == sorted(direct.arrays) == sorted(encoders.text_outputs)
            for name, array in direct.arrays.items():
                assert stored.arrays[name].dtype == np.float32 and stored.arrays[name].shape == array.shape
                np.testing.assert_allclose(stored.arrays[name], array, rtol=1e-5, atol=1e-5, err_msg=caption)


def test_a_shared_caption_is_encoded_and_stored_once(scanned: Scanned, built: Callable[[Family], Built]) -> None:
    cache = built(Family.SD)
    distinct = scanned.texts
    assert len(distinct) < len(scanned.rows)
    assert cache.summary["captions"] == cache.summary["encoded_captions"] == len(distinct)
    jobs = jobs_of(cache.path, scanned.scan)
    with CacheReader(str(cache.path)) as reader:
        assert len(reader.text_keys()) == len(distinct)
        shared = [job for job in jobs if job.caption == SHARED_CAPTION and job.path != BAD]
        assert len(shared) >= 4
        assert len({reader.latent(job.key).text_key for job in shared}) == 1
    assert shard_rows(cache.path) == (40, len(distinct))  # no caption stored twice in any shard


# --two-pass: each rank's captions with the text encoder alone, then its images with the VAE alone; the same cache
@pytest.mark.parametrize("passes", [[], ["--two-pass"]], ids=["one-pass", "two-pass"])
def test_two_ranks_give_the_same_keys_and_bitwise_equal_tensors(
    models: dict[Family, str], scanned: Scanned, built: Callable[[Family], Built], tmp_path: Path, passes: list[str]
) -> None:
    one = built(Family.SD)
    out = tmp_path / "two"
    proc = run_cache([scanned.scan, "--model", models[Family.SD], "--out", out, *FP32, *ONE_BAD, *passes], mpi=2)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    summary = summary_of(proc)
    assert summary["ranks"] == 2 and summary["two_pass"] == bool(passes) and not one.summary["two_pass"]
    for name in ("images", "captions", "encoded_images", "encoded_captions", "errors"):
        assert summary[name] == one.summary[name], name
    # the text pass's speed and memory peak: in the JSON, the summary line and each rank's progress log
    assert summary["captions_per_second"] > 0 and summary["text_peak_memory_of"] == "process peak RSS"
    assert summary["text_peak_memory_gib"] > 0.05  # a Python process with torch loaded, at least
    assert "captions/s" in proc.stderr and f"text pass peak {summary['text_peak_memory_gib']:.2f} GiB" in proc.stderr
    assert "text pass: " in proc.stderr  # rank 0's, as it goes; then every rank's, at the end
    assert ("text encoders released" in proc.stderr) == bool(passes)
    assert all(
        re.search(rf"rank {r}: \d+ images, \d+ captions \([\d.]+ s, peak [\d.]+ GiB\)", proc.stderr) for r in (0, 1)
    )

    manifest = Manifest.load(str(out))
    one_manifest = Manifest.load(str(one.path))
    assert manifest is not None and one_manifest is not None
    assert manifest.config == one_manifest.config  # the encoders' identity: either cache resumes the other
    assert {entry["name"].split("-")[1] for entry in manifest.shards} == {"r00000", "r00001"}
    assert sorted(os.listdir(out / "shards")) == sorted(entry["name"] for entry in manifest.shards)
    assert (out / "errors.jsonl").read_text() == (one.path / "errors.jsonl").read_text()
    with CacheReader(str(one.path)) as a, CacheReader(str(out)) as b:
        assert_same_latents(a, b)
        assert a.text_keys() == b.text_keys()
        for key in a.text_keys():
            x, y = a.text(key), b.text(key)
            assert x.length == y.length and sorted(x.arrays) == sorted(y.arrays)
            assert all(np.array_equal(x.arrays[n], y.arrays[n]) for n in x.arrays), key


def test_trim_padding_stores_the_real_tokens_of_the_untrimmed_encoding(
    models: dict[Family, str], scanned: Scanned, built: Callable[[Family], Built], tmp_path: Path
) -> None:
    full = built(Family.SDXL)
    out = tmp_path / "trimmed"
    proc = run_cache([scanned.scan, "--model", models[Family.SDXL], "--out", out, *FP32, *ONE_BAD, "--trim-padding"])
    assert proc.returncode == 0, proc.stderr

    trimmed_manifest, full_manifest = Manifest.load(str(out)), Manifest.load(str(full.path))
    assert trimmed_manifest is not None and full_manifest is not None
    trimmed_recipe = trimmed_manifest.cache_config(str(out)).text_recipe()
    full_recipe = full_manifest.cache_config(str(full.path)).text_recipe()
    assert trimmed_recipe != full_recipe
    with CacheReader(str(out)) as trimmed, CacheReader(str(full.path)) as padded:
        assert trimmed.latent_keys() == padded.latent_keys()  # latents do not depend on the text settings
        assert len(trimmed.text_keys()) == len(scanned.texts)
        for caption in sorted(scanned.texts):
            short, long = trimmed.text(text_key(caption, trimmed_recipe)), padded.text(text_key(caption, full_recipe))
            assert short.length == long.length < 77, caption
            assert long.arrays["prompt_embeds"].shape == (77, 96)
            assert short.arrays["prompt_embeds"].shape == (short.length, 96)
            np.testing.assert_allclose(
                short.arrays["prompt_embeds"], long.arrays["prompt_embeds"][: short.length], rtol=1e-6, atol=1e-6
            )
            # pooled vectors are not sequences: stored whole
            assert short.arrays["pooled_prompt_embeds"].shape == (64,)
            np.testing.assert_allclose(
                short.arrays["pooled_prompt_embeds"], long.arrays["pooled_prompt_embeds"], rtol=1e-6, atol=1e-6
            )


def test_info_reports_samples_buckets_bytes_and_compression(scanned: Scanned, built: Callable[[Family], Built]) -> None:
    cache = built(Family.SD)
    proc = run_cache(["info", cache.path])
    assert proc.returncode == 0, proc.stderr
    info = summary_of(proc)
    good = scanned.good
    assert (info["family"], info["latents"], info["texts"]) == ("sd", len(good), len(scanned.texts))
    assert info["buckets"] == dict(Counter(f"{r['bucket_height'] // 8}x{r['bucket_width'] // 8}" for r in good))
    shard_files = list((cache.path / "shards").glob("*.h5"))
    assert info["shards"] == len(shard_files)
    assert info["bytes"] == sum(p.stat().st_size for p in shard_files)
    # float32: a (4, h/8, w/8) mean and log-variance per image (SD's example samples), a (77, 32) embedding per caption
    assert info["settings"]["latents"]["store_logvar"] is True
    raw = sum(2 * 4 * 4 * (r["bucket_height"] // 8) * (r["bucket_width"] // 8) for r in good)
    raw += len(scanned.texts) * 77 * 32 * 4
    assert info["raw_bytes"] == raw
    assert info["compression_ratio"] == round(raw / info["bytes"], 3)
    assert info["scaling_factor"] == pytest.approx(0.18215) and info["shift_factor"] is None
    assert info["settings"]["latents"]["dtype"] == info["settings"]["text"]["dtype"] == "float32"
