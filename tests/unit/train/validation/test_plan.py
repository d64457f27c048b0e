"""The parts of validation images and caption dropout, without ranks: prompt files, the validation plan, how prompts are
split over ranks, the round's files, the EMA swapped in and out, the embeddings taken from a cache or encoded,
and caption dropout against a direct calculation. End to end (every ZeRO stage, resume, the pipeline's own
images): tests/integration/test_train.py and test_train_lora.py."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stk.errors import InputError
from stk.models import Family, build_tiny_model, load_encoders
from stk.models.families import all_specs
from stk.prompts import EMPTY_CAPTION, prompt_slug, read_prompts
from stk.train.objective.losses import LossSettings, drop_captions
from stk.train.trainable.ema import ShardedEma
from stk.train.validation.embeddings import embed_captions
from stk.train.validation.plan import ValidationSettings, parse_resolution, plan_validation
from stk.train.validation.render import _share, write_round

# --- prompt files ------------------------------------------------------------------------------------------------


def test_a_prompt_file_gives_one_prompt_per_line_without_blanks(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("  a red square \n\n\ttwo circles\n   \n", encoding="utf-8")
    assert read_prompts(str(path)) == ["a red square", "two circles"]


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"\n   \n", "no prompts in it"), (b"\xff\xfe\x00bad", "not a UTF-8 text file"), (None, "no such prompt file")],
)
def test_a_prompt_file_with_nothing_usable_is_refused(tmp_path: Path, content: bytes | None, message: str) -> None:
    path = tmp_path / "prompts.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        read_prompts(str(path))


def test_prompt_slugs_are_short_safe_file_names() -> None:
    assert prompt_slug("A Red Square, at dusk!") == "a-red-square-at-dusk"
    assert prompt_slug("!!!") == "prompt"
    long = prompt_slug("word " * 30)
    assert len(long) <= 40 and not long.endswith("-")


# --- the plan ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "size"), [("1024x768", (1024, 768)), ("512", (512, 512)), ("64X32", (64, 32))])
def test_resolutions_are_width_by_height(text: str, size: tuple[int, int]) -> None:
    assert parse_resolution(text) == size


@pytest.mark.parametrize("text", ["axb", "0x64", "64x64x64", "-8x8", ""])
def test_a_resolution_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(InputError, match="--validation-resolution"):
        parse_resolution(text)


BUCKETS = {(8, 8): 10, (8, 12): 30, (12, 8): 5}  # latent (h, w) -> samples per epoch


def test_no_prompts_anywhere_means_no_samples() -> None:
    assert plan_validation(ValidationSettings(), Family.SD, [], BUCKETS, 8) is None


def test_the_family_defaults_and_the_most_common_bucket() -> None:
    for spec in all_specs():
        family, (steps, guidance) = spec.name, (spec.sampling.steps, spec.sampling.guidance)
        plan = plan_validation(ValidationSettings(prompts=("a",)), family, [], BUCKETS, 8)
        assert plan is not None
        assert (plan.steps, plan.guidance, plan.width, plan.height) == (steps, guidance, 96, 64)
    plan = plan_validation(ValidationSettings(prompts=("a",), steps=4, guidance=0.0), Family.SD, [], BUCKETS, 8)
    assert plan is not None and (plan.steps, plan.guidance) == (4, 0.0)


def test_the_caches_prompts_serve_unless_the_run_gives_its_own_or_none(tmp_path: Path) -> None:
    cached = ["from the cache"]
    plan = plan_validation(ValidationSettings(), Family.SD, cached, BUCKETS, 8)
    assert plan is not None and plan.prompts == ("from the cache",)
    file = tmp_path / "p.txt"
    file.write_text("from the file\n")
    given = ValidationSettings(prompts=("given",), prompts_file=str(file))
    plan = plan_validation(given, Family.SD, cached, BUCKETS, 8)
    assert plan is not None and plan.prompts == ("given", "from the file")
    assert plan_validation(ValidationSettings(enabled=False), Family.SD, cached, BUCKETS, 8) is None


def test_a_size_the_family_cannot_make_is_refused() -> None:
    fits_sd = ValidationSettings(prompts=("a",), resolution=(1000, 1024))  # 1000 = 125 x 8, not a multiple of 16
    assert plan_validation(fits_sd, Family.SD, [], BUCKETS, 8) is not None
    with pytest.raises(
        InputError,
        match=r"1000x1024: Flux needs sides that are multiples of 16, nearest 992x1024 or "
        r"1008x1024; give one of those",
    ):
        plan_validation(fits_sd, Family.FLUX, [], BUCKETS, 8)
    with pytest.raises(InputError, match="multiples of 8, nearest 96x64 or 104x64"):
        plan_validation(ValidationSettings(prompts=("a",), resolution=(100, 64)), Family.SDXL, [], BUCKETS, 8)


def test_rounds_follow_step_every_n_and_the_last() -> None:
    plan = plan_validation(ValidationSettings(prompts=("a",), every=4), Family.SD, [], BUCKETS, 8)
    assert plan is not None
    assert [step for step in range(1, 11) if plan.due(step, 10)] == [4, 8, 10]
    only_ends = plan_validation(ValidationSettings(prompts=("a",), every=0), Family.SD, [], BUCKETS, 8)
    assert only_ends is not None and [step for step in range(1, 11) if only_ends.due(step, 10)] == [10]


# --- prompts over ranks ------------------------------------------------------------------------------------------


def test_prompts_are_dealt_to_ranks_and_zero3_ranks_make_spares_to_stay_in_step() -> None:
    assert [_share(3, rank, 2, zero3=False) for rank in range(2)] == [[(0, True), (2, True)], [(1, True)]]
    assert [_share(3, rank, 2, zero3=True) for rank in range(2)] == [[(0, True), (2, True)], [(1, True), (1, False)]]
    shares = [_share(2, rank, 4, zero3=True) for rank in range(4)]
    assert shares == [[(0, True)], [(1, True)], [(0, False)], [(0, False)]]
    kept = sorted(index for share in (_share(7, r, 3, True) for r in range(3)) for index, keep in share if keep)
    assert kept == list(range(7))


# --- the round's files -------------------------------------------------------------------------------------------


def _png(color: tuple[int, int, int], size: tuple[int, int] = (16, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_round_writes_each_prompt_and_a_grid_with_a_blank_where_one_failed(tmp_path: Path) -> None:
    prompts = ("red", "green", "blue")
    pngs = {0: _png((255, 0, 0)), 2: _png((0, 0, 255))}  # prompt 1 failed
    tags = write_round(str(tmp_path), 7, prompts, pngs)
    folder = tmp_path / "samples" / "step-00000007"
    assert sorted(p.name for p in folder.iterdir()) == ["0-red.png", "2-blue.png", "grid.png"]
    assert (folder / "0-red.png").read_bytes() == pngs[0]
    grid = np.asarray(Image.open(folder / "grid.png"))
    assert grid.shape == (16, 32, 3)  # 2 x 2 cells of 16 x 8
    assert (grid[0, 0] == (255, 0, 0)).all() and (grid[0, 16] == 0).all() and (grid[8, 0] == (0, 0, 255)).all()
    assert sorted(tags) == ["samples/0-red", "samples/2-blue", "samples/grid"]
    assert (tags["samples/grid"] == grid).all()
    write_round(str(tmp_path), 7, prompts, {1: _png((0, 255, 0))})  # the same step again: replaced whole
    assert sorted(p.name for p in folder.iterdir()) == ["1-green.png", "grid.png"]


# --- the EMA swapped in for a round ------------------------------------------------------------------------------


def test_the_ema_is_in_the_weights_during_a_round_and_the_trained_weights_come_back_bitwise() -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    ema = ShardedEma(module, 0.5, 1, rank=0, world=1)
    for step in range(1, 4):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p))
        ema.update(step)
    trained = [p.detach().clone() for p in module.parameters()]
    with ema.applied():
        inside = torch.cat([p.detach().flatten() for p in module.parameters()])
        assert torch.equal(inside, ema.shadow)
        assert not torch.equal(inside, torch.cat([t.flatten() for t in trained]))
    assert all(torch.equal(p, t) for p, t in zip(module.parameters(), trained, strict=True))


# --- embeddings: from the cache, else encoded ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def sd_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(Family.SD, str(tmp_path_factory.mktemp("sd") / "model"))


def test_embeddings_come_from_the_cache_and_only_the_missing_are_encoded(sd_model: str) -> None:
    encoders = load_encoders(sd_model, Family.SD, "cpu", torch.float32)
    stored = {"cached": {"prompt_embeds": np.full((77, 32), 0.5, dtype=np.float32)}}
    loads = []

    def load() -> object:
        loads.append(1)
        return encoders

    got = embed_captions(["cached", "new", EMPTY_CAPTION, "new"], stored.get, load)  # type: ignore[arg-type]
    assert sorted(got) == ["", "cached", "new"] and len(loads) == 1
    assert torch.equal(got["cached"]["prompt_embeds"], torch.full((77, 32), 0.5))
    direct = encoders.encode_text(["new", EMPTY_CAPTION])
    assert torch.equal(got["new"]["prompt_embeds"], torch.from_numpy(direct[0].arrays["prompt_embeds"]))
    assert torch.equal(got[""]["prompt_embeds"], torch.from_numpy(direct[1].arrays["prompt_embeds"]))
    embed_captions(["cached"], stored.get, load)  # type: ignore[arg-type]
    assert len(loads) == 1, "encoders loaded although the cache held every caption"


# --- caption dropout -----------------------------------------------------------------------------------------------


def test_caption_dropout_replaces_the_drawn_samples_with_the_empty_caption() -> None:
    batch = {"prompt_embeds": torch.randn(4000, 5, 3), "pooled_prompt_embeds": torch.randn(4000, 3)}
    empty = {"prompt_embeds": torch.randn(2, 3), "pooled_prompt_embeds": torch.randn(3)}  # stored without padding
    out = drop_captions(batch, empty, 0.25, torch.Generator().manual_seed(1))
    expected = torch.rand(4000, generator=torch.Generator().manual_seed(1)) < 0.25  # the same draw, made here
    blank = torch.cat([empty["prompt_embeds"], torch.zeros(3, 3)])  # zero-padded to the batch's length
    for i in range(4000):
        seq, pooled = out["prompt_embeds"][i], out["pooled_prompt_embeds"][i]
        if expected[i]:
            assert torch.equal(seq, blank) and torch.equal(pooled, empty["pooled_prompt_embeds"])
        else:
            assert torch.equal(seq, batch["prompt_embeds"][i]) and torch.equal(pooled, batch["pooled_prompt_embeds"][i])
    assert 900 < int(expected.sum()) < 1100  # 1000 expected; 5 standard deviations either way


def test_caption_dropout_pads_a_batch_shorter_than_the_empty_caption_and_zero_changes_nothing() -> None:
    batch = {"prompt_embeds": torch.randn(2, 1, 3)}
    empty = {"prompt_embeds": torch.randn(4, 3)}
    out = drop_captions(batch, empty, 1.0, torch.Generator().manual_seed(0))
    assert out["prompt_embeds"].shape == (2, 4, 3) and torch.equal(out["prompt_embeds"][1], empty["prompt_embeds"])
    assert drop_captions(batch, empty, 0.0, torch.Generator()) is batch


def test_caption_dropout_is_a_probability() -> None:
    with pytest.raises(InputError, match=r"--caption-dropout 1\.5 is a probability"):
        LossSettings(caption_dropout=1.5).check(Family.SD)
    LossSettings(caption_dropout=0.1).check(Family.FLUX)
