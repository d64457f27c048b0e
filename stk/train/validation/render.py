"""Validation images from the model being trained, on every rank, under every ZeRO stage.

The family's diffusers pipeline runs with the training denoiser itself (the LoRA in it when one is
trained; the EMA average swapped in for the round when there is one), the VAE loaded once, and the
prompts' embeddings computed once (no text encoder stays loaded). The prompts are split across the
ranks, rank r making prompts r, r + world, ... Under ZeRO-3 every forward pass gathers each layer's
weights from all ranks, so every rank makes the same number of images: a rank with fewer prompts
makes a spare one and throws it away. Prompt k is drawn from the seed + k, so an image does not
depend on the rank count, and on the CPU in fp32 the same seed gives the same PNG bytes.

Rank 0 gathers the PNGs and writes OUTPUT/samples/step-NNNNNNNN/ (one file per prompt and a grid,
the folder renamed into place whole). A round that fails on a rank (out of memory at a big
resolution, say) is one warning line and the images the other ranks made; training goes on.
"""

from __future__ import annotations

import io
import math
import os
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from stk.failures import is_out_of_memory, is_peer_failure
from stk.log import get_logger
from stk.prompts import EMPTY_CAPTION, prompt_slug
from stk.train.objective.objectives import Objective
from stk.train.trainable.pipeline import replaced_on_success
from stk.train.validation.embeddings import Embeddings
from stk.train.validation.plan import ValidationPlan

__all__ = ["SAMPLES_DIR", "ValidationRenderer", "ValidationRound", "write_round"]

log = get_logger("train")

SAMPLES_DIR = "samples"
# the pipeline's components that turn text into embeddings or check images: not loaded, the embeddings are given
_UNUSED = (
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "tokenizer",
    "tokenizer_2",
    "tokenizer_3",
    "image_encoder",
    "feature_extractor",
    "safety_checker",
)


@dataclass
class ValidationRound:
    """What rank 0 learns from a round: each prompt's PNG (by prompt index) and each rank's failure."""

    pngs: dict[int, bytes] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0  # the slowest rank's


class ValidationRenderer:
    def __init__(
        self,
        plan: ValidationPlan,
        objective: Objective,
        module: torch.nn.Module,
        embeddings: Embeddings,
        device: torch.device,
        dtype: torch.dtype,
        rank: int,
        world: int,
    ) -> None:
        self.plan, self.module, self.rank, self.world = plan, module, rank, world
        self.device, self.dtype = device, dtype
        self.pipeline = _pipeline(objective, module, device, dtype)
        spec = objective.spec
        self.guidance_argument = spec.sampling.guidance_argument
        self.inputs = [
            spec.sampling.inputs(self._conditioning(spec.sampling.negative_prompt, embeddings, prompt))
            for prompt in plan.prompts
        ]
        zero3 = any(hasattr(p, "ds_tensor") for p in module.parameters())
        self.work = _share(len(plan.prompts), rank, world, zero3)

    def _conditioning(self, negative_prompt: bool, embeddings: Embeddings, prompt: str) -> dict[str, torch.Tensor]:
        """The pipeline's embedding arguments for one prompt: its own, and for classifier-free guidance the empty
        caption's as the negative (SDXL's pipeline uses zeros instead when its config says so, as it does itself)."""
        cond = {name: value[None].to(self.device, self.dtype) for name, value in embeddings[prompt].items()}
        zeros = bool(getattr(self.pipeline.config, "force_zeros_for_empty_prompt", False))
        if not negative_prompt or zeros:
            return cond
        negative = {name: value[None].to(self.device, self.dtype) for name, value in embeddings[EMPTY_CAPTION].items()}
        out = {}
        for name in cond:
            a, b = cond[name], negative[name]
            if a.ndim == 3 and a.shape[1] != b.shape[1]:  # stored without padding: both padded alike, with zeros
                length = max(a.shape[1], b.shape[1])
                a, b = (torch.nn.functional.pad(t, (0, 0, 0, length - t.shape[1])) for t in (a, b))
            out[name], out[f"negative_{name}"] = a, b
        return out

    def render(self, weights: AbstractContextManager[None]) -> ValidationRound | None:
        """One round on every rank (a collective) with `weights` in the module for its duration (the EMA's average,
        say); rank 0 gets the round, the others None."""
        import torch.distributed as dist

        started = time.monotonic()
        pngs: dict[int, bytes] = {}
        failure = None
        try:
            with weights:
                self.module.eval()
                try:
                    for index, keep in self.work:
                        image = self._image(index)
                        if keep:
                            pngs[index] = _png(image)
                finally:
                    self.module.train()
        except Exception as exc:
            if is_peer_failure(exc):
                raise
            what = "out of memory" if is_out_of_memory(exc) else type(exc).__name__
            failure = f"rank {self.rank}: {what}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        report = (pngs, failure, time.monotonic() - started)
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        if self.world > 1:
            dist.gather_object(report, gathered, dst=0)
        elif gathered is not None:
            gathered[0] = report
        if gathered is None:
            return None
        out = ValidationRound()
        for rank_pngs, rank_failure, seconds in gathered:
            out.pngs.update(rank_pngs)
            out.seconds = max(out.seconds, seconds)
            if rank_failure:
                out.failures.append(rank_failure)
        return out

    def _image(self, index: int) -> Image.Image:
        plan = self.plan
        output = self.pipeline(
            **self.inputs[index],
            num_inference_steps=plan.steps,
            **{self.guidance_argument: plan.guidance},
            width=plan.width,
            height=plan.height,
            generator=torch.Generator().manual_seed(plan.seed + index),
            output_type="pil",
        )
        image: Image.Image = output.images[0]
        return image


def _pipeline(objective: Objective, module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> Any:
    """The family's pipeline around the training module, with the source model's VAE and scheduler only."""
    pipeline_class = objective.pipeline_class
    expected, _ = pipeline_class._get_signature_keys(pipeline_class)
    unused = {name: None for name in _UNUSED if name in expected}
    pipeline = pipeline_class.from_pretrained(
        objective.model, **{objective.denoiser_subfolder: module}, **unused, dtype=dtype
    )
    pipeline.vae.to(device)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _share(count: int, rank: int, world: int, zero3: bool) -> list[tuple[int, bool]]:
    """(prompt index, keep) in the order this rank makes them; under ZeRO-3 padded with spares to the same count
    on every rank."""
    mine = [(index, True) for index in range(rank, count, world)]
    if not zero3:
        return mine
    spare = (mine[0][0] if mine else 0, False)
    return mine + [spare] * (math.ceil(count / world) - len(mine))


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_round(output_dir: str, step: int, prompts: tuple[str, ...], pngs: dict[int, bytes]) -> dict[str, Any]:
    """OUTPUT/samples/step-NNNNNNNN/<k>-<slug>.png and grid.png (the prompts in order, a blank where one failed),
    the folder replaced whole; returns the images as arrays for TensorBoard, by tag."""
    from diffusers.utils import make_image_grid

    folder = os.path.join(output_dir, SAMPLES_DIR, f"step-{step:08d}")
    images = {k: Image.open(io.BytesIO(png)).convert("RGB") for k, png in sorted(pngs.items())}
    size = next(iter(images.values())).size
    columns = math.ceil(math.sqrt(len(prompts)))
    rows = math.ceil(len(prompts) / columns)
    cells = [images.get(k) or Image.new("RGB", size) for k in range(rows * columns)]
    grid = make_image_grid(cells, rows, columns)
    tags = {}
    with replaced_on_success(folder) as tmp:
        for k, png in sorted(pngs.items()):
            name = f"{k}-{prompt_slug(prompts[k])}"
            (tmp / f"{name}.png").write_bytes(png)
            tags[f"samples/{name}"] = np.asarray(images[k])
        grid.save(tmp / "grid.png")
    tags["samples/grid"] = np.asarray(grid)
    return tags
