"""stk.train.worldsize: a run resumed on another number of ranks. The accumulation that keeps the effective batch
and the refusal where none does (in-process, and through stk-train before any model loads); then, under ZeRO-2
(full weights, EMA in ranges) and ZeRO-3 (a LoRA, EMA in DeepSpeed's partitions), 2 ranks -> 1 -> 2 against an
uninterrupted 2-rank run: the same samples in each optimizer step, the same losses and weights. The sampler's
position and the EMA's shares on another number of ranks: test_train_sampler.py, test_train_ema.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.helpers import FAST, metrics, run_train, summary_of

from stk.errors import InputError
from stk.models import Family
from stk.train.lora import LORA_WEIGHTS
from stk.train.options import TrainOptions
from stk.train.worldsize import UNIVERSAL, accumulation_for, universal_checkpoint

UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"
SAVED = {"world_size": 2, "batch_size": 2, "grad_accum": 1, "optimizer": "adamw"}  # an effective batch of 4


@pytest.mark.parametrize(
    ("batch_size", "grad_accum", "world_size", "expected"),
    [(2, 1, 1, 2), (1, 1, 4, 1), (2, 1, 2, 1), (1, 1, 1, 4), (2, 3, 2, 3)],  # the last: as given on 2 ranks
)
def test_the_accumulation_that_keeps_the_effective_batch(batch_size, grad_accum, world_size, expected):
    assert accumulation_for(SAVED, batch_size, grad_accum, world_size, "ckpt", override=False) == expected


def test_no_accumulation_keeps_it_refused_naming_the_sizes_that_do_unless_overridden():
    message = (
        "ckpt was trained with an effective batch of 4 (2 ranks x --batch-size 2 x --grad-accum 1), which 3 ranks "
        "x --batch-size 2 cannot make: resume on 1 or 2 ranks at --batch-size 2, or add --override-resume to "
        "continue with an effective batch of 6"
    )
    with pytest.raises(InputError, match=re.escape(message)):
        accumulation_for(SAVED, 2, 1, 3, "ckpt", override=False)
    assert accumulation_for(SAVED, 2, 1, 3, "ckpt", override=True) == 1
    with pytest.raises(InputError, match=re.escape("resume with --batch-size 2, or add --override-resume")):
        accumulation_for(SAVED, 3, 1, 1, "ckpt", override=False)
    with pytest.raises(InputError, match=r"trained with Lion on 2 ranks: .* resume on 2 ranks"):
        accumulation_for({**SAVED, "optimizer": "lion"}, 2, 1, 1, "ckpt", override=False)
    assert accumulation_for({"batch_size": 2, "grad_accum": 1}, 2, 5, 3, "ckpt", override=False) == 5  # no record


def test_stk_train_refuses_before_any_model_loads(setups, tmp_path):
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    checkpoint = out / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-00000002")
    settings = TrainOptions(model=model, output_dir=str(out), batch_size=2).run_settings(Family.SD, 2)
    (checkpoint / "stk-run.json").write_text(json.dumps(settings))
    refused = run_train(["--cache", cache, "--model", model, "--output-dir", out, *FAST, "--batch-size", "3"], mpi=0)
    assert refused.returncode == InputError.exit_code, refused.stderr
    assert refused.stderr.count("cannot make: resume with --batch-size 2, or add --override-resume") == 1
    assert "DeepSpeed" not in refused.stderr and not (out / "metrics.jsonl").exists()


CASES = {
    "zero2-ema": ["--deepspeed", "zero2", "--ema-decay", "0.8"],
    "zero3-lora-ema": ["--deepspeed", "zero3", "--lora-rank", "4", "--ema-decay", "0.8"],
}


Weights = dict[str, torch.Tensor]


def final_weights(out: Path, lora: bool) -> dict[str, Weights]:
    name = LORA_WEIGHTS if lora else UNET_WEIGHTS
    return {final: load_file(out / final / name) for final in ("final", "final-no-ema")}


def drift(weights: Weights, reference: Weights, start: Weights) -> float:
    """How far weights are from reference, as a share of how far training moved reference from start. Adam's
    step is about lr wherever a gradient is near 0, so reduction order can flip single elements by up to lr:
    elementwise closeness is the wrong test, and a lost optimizer state or a wrong sample moves the whole."""
    apart = torch.cat([(weights[k] - reference[k]).flatten() for k in reference])
    moved = torch.cat([(reference[k] - start.get(k, 0 * reference[k]).float()).flatten() for k in reference])
    return float(apart.norm() / moved.norm())


@pytest.mark.integration
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_then_one_then_two_train_as_two_ranks_straight(setups, tmp_path, case):
    """A node lost after step 2 (the job requeued on 1 rank), back to 2 ranks after step 4."""
    model, cache = setups(Family.SD)
    common = ["--cache", cache, "--model", model, *FAST, *CASES[case]]  # batch 1: 2 ranks, an effective batch of 2
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_train([*common, "--output-dir", straight, "--max-steps", "6"]).returncode == 0
    assert run_train([*common, "--output-dir", split, "--max-steps", "2"]).returncode == 0
    first = split / "checkpoints" / "step-00000002"
    (first / ".universal-killed").mkdir()  # a conversion that did not finish
    one = run_train([*common, "--output-dir", split, "--max-steps", "4"], mpi=1)
    assert one.returncode == 0, one.stderr
    two = run_train([*common, "--output-dir", split, "--max-steps", "6"])
    assert two.returncode == 0, two.stderr
    assert (summary_of(one)["ranks"], summary_of(two)["ranks"]) == (1, 2)

    rows, expected = metrics(split), metrics(straight)
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == [1, 2, 3, 4, 5, 6]
    assert [r["batch_digest"] for r in rows] == [r["batch_digest"] for r in expected]  # the same samples, in place
    assert len({r["batch_digest"] for r in rows}) == 6
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
    lora = "--lora-rank" in CASES[case]
    start = {} if lora else load_file(Path(model) / UNET_WEIGHTS)  # a LoRA's weights from 0
    for final, weights in final_weights(split, lora).items():  # the trained weights, and their EMA
        assert drift(weights, final_weights(straight, lora)[final], start) < 1e-3, final

    recorded = [json.loads((split / "checkpoints" / f"step-{s:08d}" / "stk-run.json").read_text()) for s in (2, 4, 6)]
    assert [(r["world_size"], r["grad_accum"]) for r in recorded] == [(2, 1), (1, 2), (2, 1)]  # the batch kept
    converted = [first / UNIVERSAL, split / "checkpoints" / "step-00000004" / UNIVERSAL]
    assert all(path.is_dir() for path in converted) and not list(split.glob("checkpoints/*/.universal-*"))
    made = converted[0].stat().st_mtime_ns
    assert universal_checkpoint(str(first)) == str(converted[0]) and converted[0].stat().st_mtime_ns == made  # reused
