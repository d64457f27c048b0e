"""A run resumed on another number of ranks, under ZeRO-2 (full weights, EMA in ranges) and ZeRO-3 (a LoRA, EMA in
DeepSpeed's partitions): 2 ranks -> 1 -> 2 against an uninterrupted 2-rank run: the same samples in each optimizer
step, the same losses and weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.commands import FAST, run_train, summary_of
from support.train_outputs import metrics

from stk.models import Family
from stk.train.lora import LORA_WEIGHTS
from stk.train.worldsize import UNIVERSAL, universal_checkpoint

UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"


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
