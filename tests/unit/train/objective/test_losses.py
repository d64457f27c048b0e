"""stk.train.objective.losses, each option against an independent calculation of its published formula: min-SNR-gamma
weights from the betas, noise offset per image and channel, Flux's timestep sampling by its moments and the flow shift
by hand; through the family objectives on tiny real models; and settings that mean nothing refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stk.errors import InputError
from stk.models import Family, build_tiny_model
from stk.models.interface import StepInputs
from stk.train.objective.losses import LossSettings, flow_shift, min_snr_weights, offset_noise, sample_u
from stk.train.objective.objectives import objective_for


@pytest.fixture(scope="module")
def sd_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(Family.SD, str(tmp_path_factory.mktemp("sd") / "model"))


def reference_snr(timesteps: np.ndarray) -> np.ndarray:
    """SD's scaled-linear schedule (beta 0.00085 -> 0.012 over 1000 steps): SNR(t) = abar_t / (1 - abar_t)."""
    betas = np.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=np.float64) ** 2
    abar = np.cumprod(1 - betas)[timesteps]
    return abar / (1 - abar)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_min_snr_weights_follow_the_paper(sd_model, prediction):
    scheduler = objective_for(Family.SD, sd_model).scheduler
    timesteps = np.array([0, 10, 250, 500, 999])
    snr = reference_snr(timesteps)
    expected = np.minimum(snr, 5.0) / (snr if prediction == "epsilon" else snr + 1)
    got = min_snr_weights(scheduler, torch.from_numpy(timesteps), 5.0, prediction)
    assert got.numpy() == pytest.approx(expected, rel=1e-4)
    assert got[0] < 0.01 and got[-1] == pytest.approx(1.0 if prediction == "epsilon" else snr[-1] / (snr[-1] + 1))


def sd_step(model: str, settings: LossSettings, seed: int = 3) -> tuple[torch.Tensor, torch.nn.Module, StepInputs]:
    objective = objective_for(Family.SD, model, settings=settings)
    torch.manual_seed(0)
    unet = objective.load_denoiser(torch.float32)
    inputs = StepInputs(
        latents=torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1)),
        text={"prompt_embeds": torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2))},
        original_size=torch.zeros(3, 2, dtype=torch.int64),
        crop_top_left=torch.zeros(3, 2, dtype=torch.int64),
    )
    return objective.loss(unet, inputs, torch.Generator().manual_seed(seed)).detach(), unet, inputs


def test_the_sd_objective_weighs_each_sample_and_offsets_the_noise_as_written(sd_model):
    loss, unet, inputs = sd_step(sd_model, LossSettings(snr_gamma=0.2, noise_offset=0.1))
    # the same draws by hand: noise, its offset, then timesteps; noised with abar from the betas
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(inputs.latents.shape, generator=g)
    noise = noise + 0.1 * torch.randn((3, 4, 1, 1), generator=g)
    t = torch.randint(0, 1000, (3,), generator=g)
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    abar = torch.cumprod(1 - betas, 0)[t].float().view(3, 1, 1, 1)
    noisy = abar.sqrt() * inputs.latents + (1 - abar).sqrt() * noise
    with torch.no_grad():
        prediction = unet(noisy, t, encoder_hidden_states=inputs.text["prompt_embeds"]).sample
    snr = torch.from_numpy(reference_snr(t.numpy()))
    weights = torch.minimum(snr, torch.tensor(0.2)) / snr  # the tiny SD predicts epsilon
    expected = (((prediction - noise) ** 2).mean(dim=(1, 2, 3)).double() * weights).mean()
    assert float(loss) == pytest.approx(float(expected), rel=1e-4)
    plain, _, _ = sd_step(sd_model, LossSettings())
    assert float(plain) != pytest.approx(float(loss), rel=1e-3)


def test_noise_offset_is_one_draw_per_image_and_channel():
    noise = torch.zeros(2, 4, 6, 6)
    shifted = offset_noise(noise, 0.1, torch.Generator().manual_seed(9))
    planes = shifted.flatten(2)
    assert torch.equal(planes, planes[..., :1].expand_as(planes))  # constant over each image's channel
    assert torch.allclose(planes[..., 0], 0.1 * torch.randn(2, 4, generator=torch.Generator().manual_seed(9)))


@pytest.mark.parametrize(
    ("sampling", "mean", "std"), [("logit-normal", -0.5, 1.2), ("logit-normal", 0.0, 1.0), ("sigmoid", 0.0, 1.6)]
)
def test_logit_normal_and_sigmoid_sampling_have_their_moments(sampling, mean, std):
    settings = LossSettings(timestep_sampling=sampling, logit_mean=mean, logit_std=std)
    u = sample_u(settings, sampling, 200_000, torch.Generator().manual_seed(0)).double()
    assert bool(((u > 0) & (u < 1)).all())
    logits = torch.log(u / (1 - u))
    assert float(logits.mean()) == pytest.approx(mean, abs=0.01)
    assert float(logits.std()) == pytest.approx(std, rel=0.01)


def test_uniform_sampling_is_uniform():
    u = sample_u(LossSettings(), "uniform", 200_000, torch.Generator().manual_seed(0)).double()
    assert float(u.mean()) == pytest.approx(0.5, abs=0.005) and float(u.var()) == pytest.approx(1 / 12, rel=0.02)


def test_flow_shift_moves_noise_levels_toward_noise(tmp_path):
    u = torch.tensor([0.0, 0.25, 0.5, 1.0])
    assert flow_shift(u, 3.0).tolist() == pytest.approx([0.0, 0.75 / 1.5, 1.5 / 2.0, 1.0])
    assert torch.equal(flow_shift(u, 1.0), u)
    model = build_tiny_model(Family.FLUX, str(tmp_path / "flux"))
    settings = LossSettings(timestep_sampling="uniform", flow_shift=3.0)
    sigmas = objective_for(Family.FLUX, model, settings=settings).sigmas(4, 64, torch.Generator().manual_seed(5))
    u = torch.rand(4, generator=torch.Generator().manual_seed(5))
    unshifted = (1000 - (u * 1000).long()) / 1000  # the training table's entry at floor(1000 u)
    assert sigmas.tolist() == pytest.approx((3 * unshifted / (1 + 2 * unshifted)).tolist())
    example = objective_for(Family.FLUX, model).sigmas(4, 64, torch.Generator().manual_seed(5))
    assert example.tolist() == pytest.approx(unshifted.tolist())  # FLUX.1's example: uniform, no shift


@pytest.mark.parametrize(
    ("family", "settings", "message"),
    [
        (Family.FLUX, LossSettings(snr_gamma=5.0), "--snr-gamma and --noise-offset are for SD and SDXL"),
        (Family.FLUX, LossSettings(noise_offset=0.1), "--snr-gamma and --noise-offset are for SD and SDXL"),
        (Family.SDXL, LossSettings(flow_shift=3.0), "are for Chroma, Flux, .* and Z-Image"),
        (Family.SDXL, LossSettings(flow_shift="auto"), "are for Chroma, Flux, .* and Z-Image"),
        (Family.SD, LossSettings(timestep_sampling="uniform"), "are for Chroma, Flux, .* and Z-Image"),
        (Family.SD, LossSettings(snr_gamma=0.0), "--snr-gamma 0 must be positive"),
        (Family.SD, LossSettings(noise_offset=-0.1), "--noise-offset -0.1 must be 0 or more"),
        (Family.FLUX, LossSettings(logit_std=0.0), "--logit-std 0 must be positive"),
        (Family.FLUX, LossSettings(flow_shift=-1.0), "--flow-shift -1 must be a positive number"),
        (Family.FLUX, LossSettings(flow_shift=float("nan")), "--flow-shift nan must be a positive number"),
        (Family.FLUX, LossSettings(flow_shift="pipeline"), "--flow-shift pipeline: a positive number"),
        (Family.FLUX, LossSettings(logit_mean=1.0), "Flux draws uniformly by default .* --timestep-sampling logit"),
        (Family.ZIMAGE, LossSettings(logit_std=0.5), "Z-Image draws uniformly by default"),
        (Family.FLUX, LossSettings(timestep_sampling="sigmoid", logit_mean=0.5), "sigmoid is centred at 0"),
    ],
)
def test_settings_that_mean_nothing_are_refused(family, settings, message):
    with pytest.raises(InputError, match=message):
        settings.check(family)
    LossSettings().check(family)  # the defaults pass for every family
