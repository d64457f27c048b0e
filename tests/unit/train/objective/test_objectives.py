"""stk.train.objective.objectives and stk.train.trainable.pipeline on tiny random-weight pipelines of each family, on
the CPU."""

from __future__ import annotations

import filecmp
import hashlib
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, DiffusionPipeline, FluxPipeline, FluxTransformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from support.exported import files, perturbed
from support.tiny_batches import Recorder, step_inputs

from stk.errors import InputError
from stk.models import Family
from stk.models.families import spec_for
from stk.models.interface import StepInputs
from stk.train.objective.losses import LossSettings
from stk.train.objective.objectives import FlowObjective, Objective, objective_for
from stk.train.trainable.pipeline import export_pipeline

VARIANTS = [f.value for f in Family] + ["sd-v"]  # sd-v: the SD model with a v_prediction scheduler


def family_of(variant: str) -> Family:
    return Family(variant.removesuffix("-v"))


def edit_json(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_model: Callable[[Family], str]) -> dict[str, str]:
    """variant -> tiny pipeline directory; besides VARIANTS, "flux-static": Flux with a static shift of 3."""
    root = tmp_path_factory.mktemp("models")
    built = {f.value: tiny_model(f) for f in Family}
    copies: list[tuple[str, str, dict[str, Any]]] = [
        ("sd-v", "sd", {"prediction_type": "v_prediction"}),
        ("flux-static", "flux", {"use_dynamic_shifting": False}),
    ]
    for variant, source, scheduler in copies:
        built[variant] = str(shutil.copytree(built[source], root / variant))
        edit_json(root / variant / "scheduler" / "scheduler_config.json", **scheduler)
    return built


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def config_of(denoiser: torch.nn.Module) -> dict[str, Any]:
    config: Any = denoiser.config  # a diffusers model, typed as the plain Module load_denoiser returns
    return dict(config)


def setup(models: dict[str, str], variant: str, **kwargs: Any) -> tuple[Objective, torch.nn.Module, StepInputs]:
    objective = objective_for(family_of(variant), models[variant], **kwargs)
    return objective, objective.load_denoiser(torch.float32), step_inputs(family_of(variant))


# --- the loss -----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_is_a_finite_scalar_with_gradients_everywhere(models: dict[str, str], variant: str) -> None:
    objective, denoiser, inputs = setup(models, variant)
    assert denoiser.training and all(p.requires_grad for p in denoiser.parameters())
    loss = objective.loss(denoiser, inputs, seeded(1))
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    missing = {name for name, p in denoiser.named_parameters() if p.grad is None}
    assert missing == spec_for(family_of(variant)).denoiser.unreached(denoiser), f"no gradient for {missing}"
    assert all(torch.isfinite(p.grad).all() for p in denoiser.parameters() if p.grad is not None)


@pytest.mark.parametrize("variant", VARIANTS)
def test_same_seed_same_loss(models: dict[str, str], variant: str) -> None:
    objective, denoiser, inputs = setup(models, variant)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        first = objective.loss(denoiser, inputs, seeded(1))
        torch.manual_seed(12345)  # the global RNG plays no part
        again = objective.loss(denoiser, inputs, seeded(1))
        other = objective.loss(denoiser, inputs, seeded(2))
    assert torch.equal(first, again)
    assert not torch.isclose(first, other)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_few_steps_lower_the_loss(models: dict[str, str], variant: str) -> None:
    objective, denoiser, inputs = setup(models, variant)
    optimizer = torch.optim.AdamW(denoiser.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = objective.loss(denoiser, inputs, seeded(7))  # the same noise and timesteps every step
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.95 * losses[0], losses


@pytest.mark.parametrize("family", list(Family), ids=lambda f: f.value)
def test_bfloat16_denoiser(models: dict[str, str], family: Family) -> None:
    objective = objective_for(family, models[family.value])
    denoiser = objective.load_denoiser(torch.bfloat16)
    assert {p.dtype for p in denoiser.parameters()} == {torch.bfloat16}
    inputs = step_inputs(family)
    inputs.latents = inputs.latents.bfloat16()
    inputs.text = {name: t.bfloat16() for name, t in inputs.text.items()}
    loss = objective.loss(denoiser, inputs, seeded(1))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_sd_epsilon_and_v_prediction_targets(models: dict[str, str]) -> None:
    """The loss against each target computed here from what the UNet received: the noise recovered from the noisy
    latents, and the velocity the scheduler derives from it."""
    inputs = step_inputs(Family.SD)
    denoiser = Recorder(objective_for(Family.SD, models["sd"]).load_denoiser(torch.float32))
    losses = {}
    for variant in ("sd", "sd-v"):
        losses[variant] = objective_for(Family.SD, models[variant]).loss(denoiser, inputs, seeded(3))
    scheduler = DDPMScheduler.from_pretrained(models["sd-v"], subfolder="scheduler")
    assert scheduler.config.prediction_type == "v_prediction"
    (eps_args, _, eps_pred), (v_args, _, v_pred) = denoiser.calls
    noisy, timesteps = eps_args
    assert torch.equal(noisy, v_args[0]) and torch.equal(timesteps, v_args[1])  # same seed: only the target differs
    assert timesteps.dtype == torch.int64 and ((timesteps >= 0) & (timesteps < 1000)).all()
    alpha = scheduler.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
    noise = (noisy - alpha.sqrt() * inputs.latents) / (1 - alpha).sqrt()
    velocity = scheduler.get_velocity(inputs.latents, noise, timesteps)
    assert not torch.allclose(velocity, noise, atol=0.1)
    torch.testing.assert_close(losses["sd"], F.mse_loss(eps_pred, noise), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(losses["sd-v"], F.mse_loss(v_pred, velocity), rtol=1e-4, atol=1e-6)
    assert not torch.isclose(losses["sd"], losses["sd-v"])


def test_sdxl_time_ids(models: dict[str, str]) -> None:
    objective = objective_for(Family.SDXL, models["sdxl"])
    denoiser = Recorder(objective.load_denoiser(torch.float32))
    inputs = step_inputs(Family.SDXL, size=(8, 6))  # 64 x 48 pixels: height and width must not swap
    objective.loss(denoiser, inputs, seeded(1))
    [(_, kwargs, output)] = denoiser.calls
    added = kwargs["added_cond_kwargs"]
    expected = torch.tensor([[100, 120, 3, 5, 64, 48], [64, 80, 0, 7, 64, 48]], dtype=torch.float32)
    assert added["time_ids"].dtype == torch.float32
    assert torch.equal(added["time_ids"], expected)
    assert added["text_embeds"] is inputs.text["pooled_prompt_embeds"]
    assert kwargs["encoder_hidden_states"] is inputs.text["prompt_embeds"]
    assert output.shape == inputs.latents.shape


def test_flux_packs_latents_and_passes_guidance(models: dict[str, str]) -> None:
    objective = objective_for(Family.FLUX, models["flux"], guidance_scale=5.0)
    denoiser = Recorder(objective.load_denoiser(torch.float32))
    inputs = step_inputs(Family.FLUX, size=(8, 6))
    loss = objective.loss(denoiser, inputs, seeded(1))
    [(_, kwargs, prediction)] = denoiser.calls
    hidden, sigma = kwargs["hidden_states"], kwargs["timestep"]
    assert hidden.shape == prediction.shape == (2, 4 * 3, 16 * 4)
    assert torch.equal(kwargs["img_ids"], FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32))
    assert torch.equal(kwargs["txt_ids"], torch.zeros(16, 3))
    assert torch.equal(kwargs["guidance"], torch.full((2,), 5.0))
    assert kwargs["pooled_projections"] is inputs.text["pooled_prompt_embeds"]
    assert kwargs["encoder_hidden_states"] is inputs.text["prompt_embeds"]
    assert kwargs["return_dict"] is False
    assert sigma.shape == (2,) and ((sigma > 0) & (sigma < 1)).all()
    # The target, from what the transformer received: noisy = (1 - sigma) x + sigma noise, target = noise - x.
    latents = FluxPipeline._pack_latents(inputs.latents, 2, 16, 8, 6)
    s = sigma.view(-1, 1, 1)
    noise = (hidden - (1 - s) * latents) / s
    torch.testing.assert_close(loss, F.mse_loss(prediction, noise - latents), rtol=1e-4, atol=1e-6)


def test_flux_without_guidance_embeds(models: dict[str, str]) -> None:
    objective = objective_for(Family.FLUX, models["flux"])
    config = config_of(objective.load_denoiser(torch.float32))
    denoiser = Recorder(FluxTransformer2DModel.from_config({**config, "guidance_embeds": False}))
    loss = objective.loss(denoiser, step_inputs(Family.FLUX), seeded(1))
    assert torch.isfinite(loss)
    assert denoiser.calls[0][1]["guidance"] is None


def test_flux_sigmas_are_the_examples_table_or_shifted_like_the_pipeline(models: dict[str, str]) -> None:
    u = torch.rand(64, generator=seeded(5))  # FLUX.1's example: uniform
    unshifted = (1000 - (u * 1000).long()) / 1000  # its scheduler's table, unshifted (it shifts dynamically)
    torch.testing.assert_close(objective_for(Family.FLUX, models["flux"]).sigmas(64, 64, seeded(5)), unshifted)
    dynamic = objective_for(Family.FLUX, models["flux"], settings=LossSettings(flow_shift="auto"))
    assert isinstance(dynamic, FlowObjective)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (64 - 256)  # tiny config: base 256/0.5, max 4096/1.15
    expected = math.exp(mu) / (math.exp(mu) + (1 / unshifted - 1))
    torch.testing.assert_close(dynamic.sigmas(64, 64, seeded(5)), expected)
    assert (dynamic.sigmas(64, 4096, seeded(5)) > dynamic.sigmas(64, 256, seeded(5))).all()  # larger: noisier
    static = objective_for(Family.FLUX, models["flux-static"])  # a static shift 3 shifts the table itself
    assert isinstance(static, FlowObjective)
    torch.testing.assert_close(static.sigmas(64, 64, seeded(5)), 3 * unshifted / (1 + 2 * unshifted))


def test_flux2s_auto_shift_is_its_pipelines_empirical_mu(models: dict[str, str]) -> None:
    """Flux2Pipeline shifts by compute_empirical_mu at its 50 steps, not by its scheduler config's line."""
    objective = objective_for(Family.FLUX2, models["flux2"], settings=LossSettings(flow_shift="auto"))
    assert isinstance(objective, FlowObjective)
    unshifted = (1000 - (torch.rand(64, generator=seeded(5)) * 1000).long()) / 1000
    for tokens in (256, 4096, 8192):
        mu = compute_empirical_mu(tokens, 50)
        expected = math.exp(mu) / (math.exp(mu) + (1 / unshifted - 1))
        torch.testing.assert_close(objective.sigmas(64, tokens, seeded(5)), expected)


# --- errors ---------------------------------------------------------------------------------


def test_missing_denoiser_folder(models: dict[str, str], tmp_path: Path) -> None:
    model = shutil.copytree(models["sd"], tmp_path / "sd", ignore=shutil.ignore_patterns("unet"))
    objective = objective_for(Family.SD, str(model))
    with pytest.raises(InputError, match="unet") as error:
        objective.load_denoiser(torch.float32)
    assert "\n" not in str(error.value)


def test_unloadable_denoiser_weights(models: dict[str, str], tmp_path: Path) -> None:
    model = shutil.copytree(models["flux"], tmp_path / "flux")
    (model / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InputError, match="transformer") as error:
        objective_for(Family.FLUX, str(model)).load_denoiser(torch.float32)
    assert "\n" not in str(error.value)


def test_missing_scheduler_or_unsupported_prediction_type(models: dict[str, str], tmp_path: Path) -> None:
    model = shutil.copytree(models["sdxl"], tmp_path / "sdxl", ignore=shutil.ignore_patterns("scheduler"))
    with pytest.raises(InputError, match="scheduler") as error:
        objective_for(Family.SDXL, str(model))
    assert "\n" not in str(error.value)
    shutil.copytree(Path(models["sdxl"]) / "scheduler", model / "scheduler")
    edit_json(model / "scheduler" / "scheduler_config.json", prediction_type="sample")
    with pytest.raises(InputError, match="'sample'"):
        objective_for(Family.SDXL, str(model))


# --- export -------------------------------------------------------------------------------


def test_export_replaces_the_old_model_only_when_complete(models: dict[str, str], tmp_path: Path) -> None:
    objective = objective_for(Family.SD, models["sd"])
    denoiser = objective.load_denoiser(torch.float32)
    config, out = config_of(denoiser), tmp_path / "final"
    weights = out / "unet" / "diffusion_pytorch_model.safetensors"

    export_pipeline(models["sd"], "unet", objective.denoiser_class, config, perturbed(denoiser, 1), str(out))
    first = weights.read_bytes()
    broken = perturbed(denoiser, 2)
    broken.pop(next(iter(broken)))
    with pytest.raises(RuntimeError, match="Missing key"):
        export_pipeline(models["sd"], "unet", objective.denoiser_class, config, broken, str(out))
    assert weights.read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]

    export_pipeline(models["sd"], "unet", objective.denoiser_class, config, perturbed(denoiser, 3), str(out))
    assert weights.read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def cache_as_hub_snapshot(model: Path, cache: Path, repo_id: str) -> Path:
    """Lay `model` out as the hub cache does (files in a snapshot are symlinks into blobs/); returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    for path in sorted(p for p in model.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(model)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_export_from_a_hub_id_offline(models: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = cache_as_hub_snapshot(Path(models["sd"]), tmp_path / "hub", "stk-test/tiny-sd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    objective = objective_for(Family.SD, "stk-test/tiny-sd")
    denoiser = objective.load_denoiser(torch.float32)
    state, out = perturbed(denoiser, 1), tmp_path / "final"
    export_pipeline("stk-test/tiny-sd", "unet", objective.denoiser_class, config_of(denoiser), state, str(out))
    assert files(out, "unet") == files(snapshot, "unet")
    assert not any(p.is_symlink() for p in out.rglob("*"))  # real files, not links into this machine's cache
    assert all(filecmp.cmp(snapshot / f, out / f, shallow=False) for f in files(snapshot, "unet"))
    exported = DiffusionPipeline.from_pretrained(str(out)).unet.state_dict()
    assert all(torch.equal(exported[k], state[k]) for k in state)


# --- gradient checkpointing ---------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradient_checkpointing_changes_no_bit_of_the_loss_or_the_gradients(
    models: dict[str, str], variant: str
) -> None:
    """It only recomputes activations in the backward pass: fp32 on the CPU, every bit the same."""
    results = []
    for checkpointing in (False, True):
        objective, denoiser, inputs = setup(models, variant)
        if checkpointing:
            denoiser.enable_gradient_checkpointing()
        assert denoiser.is_gradient_checkpointing is checkpointing
        loss = objective.loss(denoiser, inputs, seeded(1))
        loss.backward()
        results.append((loss, {name: p.grad for name, p in denoiser.named_parameters()}))
    (plain_loss, plain_grads), (loss, grads) = results
    assert torch.equal(plain_loss, loss)
    assert plain_grads.keys() == grads.keys()
    differ = [
        name
        for name, grad in grads.items()  # None alike where no forward pass reaches a parameter
        if (plain_grads[name] is None) != (grad is None)
        or (grad is not None and not torch.equal(plain_grads[name], grad))
    ]
    assert not differ, differ
