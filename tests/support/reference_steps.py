"""What the reference-loss tests share: one training step of stk's objective beside a transcription of diffusers'
training example for the family, on the same tiny denoiser, batch, noise and timesteps (fp32, CPU), and the check
that the two agree in the loss and in every parameter's gradient."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from diffusers.training_utils import compute_loss_weighting_for_sd3
from diffusers.utils.torch_utils import randn_tensor

from stk.models import Family, build_tiny_model
from stk.models.interface import StepInputs
from stk.train.objective.objectives import FlowObjective, Objective, objective_for
from support.tiny_batches import step_inputs

SEED = 3
# (the denoiser, the batch, the noise, the timesteps or sigmas the objective drew) -> the example's loss
Reference = Callable[[torch.nn.Module, StepInputs, torch.Tensor, torch.Tensor], torch.Tensor]


def example_flow_loss(
    model_pred: torch.Tensor, noise: torch.Tensor, model_input: torch.Tensor, sigmas: torch.Tensor
) -> torch.Tensor:
    """The loss lines diffusers' flow-matching dreambooth examples share, at their default weighting ("none"):
    transcribed once for the transcriptions of each family's example."""
    weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean(
        (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1),
        1,
    )
    return loss.mean()


def tiny_objective(family: Family, folder: str) -> tuple[Objective, torch.nn.Module]:
    """The family's objective on a tiny random-weight pipeline, and its denoiser in fp32."""
    objective = objective_for(family, build_tiny_model(family, folder))
    return objective, objective.load_denoiser(torch.float32)


def drawn(objective: Objective, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise and the timesteps (DDPM) or sigmas (flow) the objective draws from generator SEED, drawn here in
    the order it draws them."""
    latents = inputs.latents
    g = torch.Generator().manual_seed(SEED)
    noise = randn_tensor(latents.shape, generator=g, dtype=latents.dtype)
    if isinstance(objective, FlowObjective):
        b, _, h, w = latents.shape
        patch = objective.spec.latents.patch_size
        return noise, objective.sigmas(b, (h // patch) * (w // patch), g)
    steps = objective.scheduler.config["num_train_timesteps"]
    return noise, torch.randint(0, steps, (len(latents),), generator=g)


def assert_matches_reference(
    objective: Objective, denoiser: torch.nn.Module, reference: Reference, inputs: StepInputs | None = None
) -> None:
    """stk's loss and gradients equal the transcription's on `inputs` (else a random batch), and the step is not
    trivial (a nonzero gradient)."""
    inputs = inputs or step_inputs(objective.family)
    theirs_model = copy.deepcopy(denoiser)
    noise, steps = drawn(objective, inputs)
    ours = objective.loss(denoiser, inputs, torch.Generator().manual_seed(SEED))
    theirs = reference(theirs_model, inputs, noise, steps)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    ours.backward()
    theirs.backward()
    grads = dict(theirs_model.named_parameters())
    unused = objective.spec.denoiser.unreached(denoiser)
    for name, p in denoiser.named_parameters():
        if name in unused:
            assert p.grad is None and grads[name].grad is None, name
            continue
        assert p.grad is not None and grads[name].grad is not None, name
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    assert any(p.grad.abs().sum() > 0 for p in denoiser.parameters() if p.grad is not None)
