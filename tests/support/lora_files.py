"""A LoRA as stk-train saves one, and the family's pipeline loading it with its own load_lora_weights: what each
family's tests check of its adapter format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft.utils import get_peft_model_state_dict

from stk.models import Family
from stk.models.families import spec_for
from stk.train.objective.objectives import objective_for
from stk.train.trainable.lora import LORA_WEIGHTS, LoraSettings, add_lora, save_lora
from support.tiny_batches import step_inputs


def saved_lora(family: Family, model: str, out: Path, base_precision: str = "bf16") -> torch.nn.Module:
    """The family's denoiser (its base quantised as `base_precision` says) with a rank-4 adapter on its default
    targets whose B weights are random (as if trained; they start at zero), saved to `out` as stk saves one; the
    adapted module, in eval mode."""
    spec, settings = spec_for(family), LoraSettings(rank=4, alpha=8)
    denoiser = objective_for(family, model).load_denoiser(torch.float32, base_precision=base_precision)
    assert add_lora(denoiser, settings, family, seed=0) > 0
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in denoiser.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    state = get_peft_model_state_dict(denoiser)
    save_lora(spec.pipeline_class, spec.denoiser.subfolder, settings.config(family), state, str(out))
    assert (out / LORA_WEIGHTS).is_file()
    return denoiser.eval()


def _output(module: torch.nn.Module, call: dict[str, Any]) -> torch.Tensor:
    """The denoiser's prediction, flattened (Z-Image's transformer returns a list of tensors)."""
    with torch.no_grad():
        out = module(**call, return_dict=False)[0]
    return torch.cat([t.flatten() for t in out]) if isinstance(out, list) else out.flatten()


def training_prediction(family: Family, model: str, denoiser: torch.nn.Module) -> torch.Tensor:
    """The denoiser's prediction as stk-train calls it (the spec's `denoise`) on a tiny batch of two, at two noise
    levels: any family's denoiser, called the one way every family shares."""
    objective = objective_for(family, model)
    inputs = step_inputs(family, size=(8, 6))
    levels = torch.tensor([0.3, 0.6]) if objective.spec.denoiser.flow else torch.tensor([500, 250])
    with torch.no_grad():
        return objective.spec.denoiser.denoise(objective, denoiser, inputs.latents, levels, inputs).flatten()


def assert_pipeline_loads_it(
    family: Family,
    model: str,
    lora: Path,
    trained: torch.nn.Module,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **call: Any,
) -> None:
    """The family's pipeline, given the saved adapter with load_lora_weights, predicts what the trained module does
    on `call` (the denoiser's arguments; without them, as stk-train calls it) within rtol and atol (a module trained
    on a quantised base differs by the base's rounding), and not what the base does."""
    spec = spec_for(family)
    pipeline = spec.pipeline_class.from_pretrained(model)
    denoiser = getattr(pipeline, spec.denoiser.subfolder)

    def predict(module: torch.nn.Module) -> torch.Tensor:
        return _output(module, call) if call else training_prediction(family, model, module)

    base = predict(denoiser)
    pipeline.load_lora_weights(lora)
    loaded = predict(denoiser)
    torch.testing.assert_close(loaded, predict(trained), rtol=rtol, atol=atol)
    assert not torch.allclose(loaded, base, rtol=1e-4, atol=1e-6), "the LoRA changed nothing"
