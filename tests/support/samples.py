"""A sample image as stk-train renders one from cached embeddings: what each family's tests compare with the image its
pipeline makes from the prompt's text."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import torch
from PIL import Image

from stk.models import Family
from stk.models.families import spec_for
from stk.prompts import EMPTY_CAPTION
from stk.train.objective.objectives import objective_for
from stk.train.validation.embeddings import embed_captions
from stk.train.validation.plan import ValidationPlan
from stk.train.validation.render import ValidationRenderer


def rendered_sample(family: Family, model: str, plan: ValidationPlan) -> np.ndarray:
    """The renderer's image of `plan`'s one prompt, fp32 on the CPU: the prompt's and the empty caption's embeddings
    as the cache stores them (real tokens only where the family masks padding), then `sample_inputs`. int16 RGB."""
    encoders = spec_for(family).text.encoders.load(model, torch.device("cpu"), torch.float32)
    embeddings = embed_captions([*plan.prompts, EMPTY_CAPTION], lambda caption: None, lambda: encoders)
    objective = objective_for(family, model)
    denoiser = objective.load_denoiser(torch.float32)
    renderer = ValidationRenderer(plan, objective, denoiser, embeddings, torch.device("cpu"), torch.float32, 0, 1)
    (sample,) = renderer.render(contextlib.nullcontext()).pngs.values()
    return np.asarray(Image.open(io.BytesIO(sample)), dtype=np.int16)
