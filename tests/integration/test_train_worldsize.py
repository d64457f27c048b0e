"""A run resumed on another number of ranks, under ZeRO-2 (full weights, EMA in ranges) and ZeRO-3 (a LoRA, EMA in
DeepSpeed's partitions): 2 ranks -> 1 -> 2 against an uninterrupted 2-rank run: the same samples in each optimizer
step, the same losses and weights. ZeRO-2's uninterrupted run is the session's `trained`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.commands import FAST, run_train, summary_of
from support.train_outputs import metrics

from stk.models import Family
from stk.train.checkpoint.store import LATEST
from stk.train.checkpoint.worldsize import UNIVERSAL, universal_checkpoint
from stk.train.trainable.lora import LORA_WEIGHTS

UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"


CASES = {
    "zero2-ema": ["--deepspeed", "zero2", "--ema-decay", "0.8"],  # the `trained` fixture's run: ZeRO-2, an EMA of 0.8
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


def first_two_steps(
    case: str, setups: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[list[Any], Path, Path]:
    """(the arguments of the case's runs less --output-dir and --max-steps, an uninterrupted 4-step 2-rank run, a run
    ended after step 2's checkpoint). ZeRO-2's are the session's `trained` run (4 steps, a checkpoint every 2) and a
    copy of it as a job lost after step 2 leaves it; ZeRO-3's LoRA trains its own."""
    if case == "zero2-ema":
        args, straight = request.getfixturevalue("trained")
        split = request.getfixturevalue("copied")[1]
        shutil.rmtree(split / "checkpoints" / "step-00000004")
        (split / "checkpoints" / LATEST).write_text("step-00000002")
        return args, straight, split
    model, cache = setups(Family.SD)
    common = ["--cache", cache, "--model", model, *FAST, *CASES[case]]  # batch 1: 2 ranks, an effective batch of 2
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_train([*common, "--output-dir", straight, "--max-steps", "4"]).returncode == 0
    assert run_train([*common, "--output-dir", split, "--max-steps", "2"]).returncode == 0
    return common, straight, split


@pytest.mark.integration
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_then_one_then_two_train_as_two_ranks_straight(setups, request, tmp_path, case):
    """A node lost after step 2 (the job requeued on 1 rank), back to 2 ranks after step 3."""
    common, straight, split = first_two_steps(case, setups, request, tmp_path)
    first = split / "checkpoints" / "step-00000002"
    (first / ".universal-killed").mkdir()  # a conversion that did not finish
    one = run_train([*common, "--output-dir", split, "--max-steps", "3"], mpi=1)
    assert one.returncode == 0, one.stderr
    converted = first / UNIVERSAL
    assert converted.is_dir() and not list(first.glob(".universal-*"))
    made = converted.stat().st_mtime_ns
    assert universal_checkpoint(str(first)) == str(converted) and converted.stat().st_mtime_ns == made  # reused
    two = run_train([*common, "--output-dir", split, "--max-steps", "4"])
    assert two.returncode == 0, two.stderr
    assert (summary_of(one)["ranks"], summary_of(two)["ranks"]) == (1, 2)

    rows, expected = metrics(split), metrics(straight)
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == [1, 2, 3, 4]
    assert [r["batch_digest"] for r in rows] == [r["batch_digest"] for r in expected]  # the same samples, in place
    assert len({r["batch_digest"] for r in rows}) == 4
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
    lora = "--lora-rank" in CASES[case]
    model = str(common[common.index("--model") + 1])
    start = {} if lora else load_file(Path(model) / UNET_WEIGHTS)  # a LoRA's weights from 0
    for final, weights in final_weights(split, lora).items():  # the trained weights, and their EMA
        assert drift(weights, final_weights(straight, lora)[final], start) < 1e-3, final

    recorded = [json.loads((split / "checkpoints" / f"step-{s:08d}" / "stk-run.json").read_text()) for s in (3, 4)]
    assert [(r["world_size"], r["grad_accum"]) for r in recorded] == [(1, 2), (2, 1)]  # the batch kept
    assert (split / "checkpoints" / "step-00000003" / UNIVERSAL).is_dir()
    assert not list(split.glob("checkpoints/*/.universal-*"))
