"""Each model family's training loss, written as diffusers' own training examples write it, so a fine-tune learns
what the family's pipeline will ask of it at inference.

All randomness (noise, timesteps, sigmas) comes from the caller's CPU generator and is then moved to the latents'
device: a step is reproducible from its seed on any device and any number of ranks.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, calculate_shift
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import StableDiffusionPipeline
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import StableDiffusionXLPipeline
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from stk.errors import InputError
from stk.models.components import load_component
from stk.models.detect import Family, vae_scale_factor
from stk.train.batch import StepInputs
from stk.train.losses import LossSettings, flow_shift, min_snr_weights, offset_noise, sample_u
from stk.train.weights import load_weights, load_weights_partitioned, weight_files
from stk.world import World

__all__ = ["OBJECTIVES", "FluxObjective", "Objective", "SDObjective", "SDXLObjective", "objective_for"]

PREDICTION_TYPES = ("epsilon", "v_prediction")
PLAIN_LOSS = LossSettings()  # frozen: plain MSE and the pipeline's own Flux schedule


class Objective(abc.ABC):
    """One model family's denoiser and loss. Reads only configs when built; `load_denoiser` loads the weights."""

    family: ClassVar[Family]
    denoiser_subfolder: ClassVar[str]  # "unet" or "transformer"
    denoiser_class: ClassVar[type[Any]]  # a diffusers ModelMixin (and ConfigMixin)
    pipeline_class: ClassVar[type[Any]]  # whose save_lora_weights writes the family's LoRA format

    def __init__(self, model: str, guidance_scale: float = 3.5, settings: LossSettings = PLAIN_LOSS) -> None:
        self.model = model  # local diffusers pipeline directory or hub id
        self.guidance_scale = guidance_scale  # only guidance-distilled models (Flux dev) use it
        self.settings = settings

    def _check_denoiser_folder(self) -> None:
        if Path(self.model).is_dir() and not (Path(self.model) / self.denoiser_subfolder).is_dir():
            raise InputError(
                f"{self.model} has no {self.denoiser_subfolder}/ folder: not a complete {self.family.value} pipeline"
            )

    def denoiser_config(self) -> dict[str, Any]:
        """The denoiser's config.json, read without its weights."""
        self._check_denoiser_folder()
        config: dict[str, Any] = load_component(self.denoiser_class.load_config, self.model, self.denoiser_subfolder)
        return config

    def _weight_files(self) -> list[Path] | None:
        """The denoiser's safetensors files on this machine (a hub id: from the hub cache, fetched when online)."""
        if Path(self.model).is_dir():
            return weight_files(Path(self.model) / self.denoiser_subfolder)
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(self.model, allow_patterns=[f"{self.denoiser_subfolder}/*"])
        except Exception:  # offline and not cached, no such repo: from_pretrained below says so in its words
            return None
        return weight_files(Path(folder) / self.denoiser_subfolder)

    def load_denoiser(
        self, dtype: torch.dtype, world: World | None = None, zero3_config: dict[str, Any] | None = None
    ) -> torch.nn.Module:
        """The denoiser in `dtype`, in train mode with every parameter trainable, never more than once in memory
        (stk.train.weights). With `world` and `zero3_config` (a ZeRO-3 run's DeepSpeed config) it is built
        partitioned across the ranks, and every rank must call this."""
        config = self.denoiser_config()
        files = self._weight_files()
        if files is None:  # no safetensors (.bin weights): diffusers' own loading
            module = load_component(
                self.denoiser_class.from_pretrained, self.model, self.denoiser_subfolder, dtype=dtype
            )
        elif world is not None and zero3_config is not None:
            module = load_weights_partitioned(self.denoiser_class, config, files, world, zero3_config)
        else:
            module = load_weights(self.denoiser_class, config, files, dtype)
        module.train()
        module.requires_grad_(True)
        return module

    @abc.abstractmethod
    def loss(self, denoiser: torch.nn.Module, inputs: StepInputs, generator: torch.Generator) -> torch.Tensor:
        """Scalar float32 MSE of one micro-batch. `denoiser` is the module or a DeepSpeed engine around it."""


class SDObjective(Objective):
    """SD 1.x/2.x: DDPM noise prediction (epsilon or v), as in diffusers' train_text_to_image.py. The scheduler
    config the pipeline ships (PNDM, Euler, ...) holds the betas and prediction type the UNet was trained with."""

    family = Family.SD
    denoiser_subfolder = "unet"
    denoiser_class = UNet2DConditionModel
    pipeline_class: ClassVar[type[Any]] = StableDiffusionPipeline

    def __init__(self, model: str, guidance_scale: float = 3.5, settings: LossSettings = PLAIN_LOSS) -> None:
        super().__init__(model, guidance_scale, settings)
        self.scheduler = load_component(DDPMScheduler.from_pretrained, model, "scheduler")
        self.prediction_type = self.scheduler.config["prediction_type"]
        if self.prediction_type not in PREDICTION_TYPES:
            raise InputError(
                f"{model}/scheduler: prediction_type {self.prediction_type!r} cannot be trained; stk trains "
                + " or ".join(PREDICTION_TYPES)
            )

    def conditioning(self, inputs: StepInputs) -> dict[str, Any]:
        """The UNet's keyword arguments besides the noisy latents and timesteps."""
        return {"encoder_hidden_states": inputs.text["prompt_embeds"]}

    def loss(self, denoiser: torch.nn.Module, inputs: StepInputs, generator: torch.Generator) -> torch.Tensor:
        latents = inputs.latents
        noise = randn_tensor(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
        if self.settings.noise_offset:
            noise = offset_noise(noise, self.settings.noise_offset, generator)
        steps = self.scheduler.config["num_train_timesteps"]
        timesteps = torch.randint(0, steps, (len(latents),), generator=generator).to(latents.device)
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        target = noise if self.prediction_type == "epsilon" else self.scheduler.get_velocity(latents, noise, timesteps)
        prediction = denoiser(noisy, timesteps, **self.conditioning(inputs), return_dict=False)[0]
        gamma = self.settings.snr_gamma
        if gamma is None:
            return F.mse_loss(prediction.float(), target.float())
        per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
        return (per_sample * min_snr_weights(self.scheduler, timesteps, gamma, self.prediction_type)).mean()


class SDXLObjective(SDObjective):
    """SDXL: DDPM plus the pooled text embedding and the size and crop conditioning ("time ids")."""

    family = Family.SDXL
    pipeline_class = StableDiffusionXLPipeline

    def __init__(self, model: str, guidance_scale: float = 3.5, settings: LossSettings = PLAIN_LOSS) -> None:
        super().__init__(model, guidance_scale, settings)
        self.vae_scale_factor = vae_scale_factor(model)

    def conditioning(self, inputs: StepInputs) -> dict[str, Any]:
        """Time ids per sample: original (h, w), crop (top, left), target (h, w), the order of
        StableDiffusionXLPipeline._get_add_time_ids; the target is the size the latents decode to."""
        latents = inputs.latents
        device, (b, _, h, w) = latents.device, latents.shape
        target = torch.tensor([[h, w]], device=device).expand(b, 2) * self.vae_scale_factor
        time_ids = torch.cat([inputs.original_size.to(device), inputs.crop_top_left.to(device), target], dim=1)
        added = {"text_embeds": inputs.text["pooled_prompt_embeds"], "time_ids": time_ids.to(latents.dtype)}
        return {**super().conditioning(inputs), "added_cond_kwargs": added}


class FluxObjective(Objective):
    """Flux: rectified flow matching as in diffusers' train_dreambooth_flux.py, the transformer predicting
    noise - latents from packed 2x2 patches. Sigmas are drawn logit-normal and then shifted like FluxPipeline
    shifts its schedule, so training spends its steps on the noise levels inference visits at this resolution."""

    family = Family.FLUX
    denoiser_subfolder = "transformer"
    denoiser_class = FluxTransformer2DModel
    pipeline_class = FluxPipeline

    def __init__(self, model: str, guidance_scale: float = 3.5, settings: LossSettings = PLAIN_LOSS) -> None:
        super().__init__(model, guidance_scale, settings)
        self.scheduler = load_component(FlowMatchEulerDiscreteScheduler.from_pretrained, model, "scheduler")

    def sigmas(self, batch_size: int, image_seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """(batch_size,) float32 noise levels in (0, 1) on the CPU, for images of `image_seq_len` packed tokens:
        drawn as --timestep-sampling says, shifted by --flow-shift or else as the pipeline's scheduler shifts."""
        u = sample_u(self.settings, batch_size, generator)
        if self.settings.flow_shift is not None:
            return flow_shift(u, self.settings.flow_shift)
        config = self.scheduler.config
        if config["use_dynamic_shifting"]:
            mu = calculate_shift(
                image_seq_len,
                config["base_image_seq_len"],
                config["max_image_seq_len"],
                config["base_shift"],
                config["max_shift"],
            )
            shifted: torch.Tensor = self.scheduler.time_shift(mu, 1.0, u)
            return shifted
        return flow_shift(u, float(config["shift"]))

    def loss(self, denoiser: torch.nn.Module, inputs: StepInputs, generator: torch.Generator) -> torch.Tensor:
        latents = inputs.latents
        b, c, h, w = latents.shape
        if h % 2 or w % 2:
            raise ValueError(f"Flux packs 2x2 latent patches: latent height and width must be even, got {h}x{w}")
        device, dtype = latents.device, latents.dtype
        noise = randn_tensor(latents.shape, generator=generator, device=device, dtype=dtype)
        sigmas = self.sigmas(b, (h // 2) * (w // 2), generator).to(device, dtype)
        sigma = sigmas.view(b, 1, 1, 1)
        noisy = (1 - sigma) * latents + sigma * noise
        module: Any = getattr(denoiser, "module", denoiser)  # a DeepSpeed engine holds the model as .module
        guidance = torch.full((b,), self.guidance_scale, device=device) if module.config.guidance_embeds else None
        prompt_embeds = inputs.text["prompt_embeds"]
        prediction = denoiser(
            hidden_states=FluxPipeline._pack_latents(noisy, b, c, h, w),
            timestep=sigmas,  # FluxPipeline passes timestep / 1000 with timestep = sigma * 1000
            guidance=guidance,
            pooled_projections=inputs.text["pooled_prompt_embeds"],
            encoder_hidden_states=prompt_embeds,
            txt_ids=torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype),
            img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype),
            return_dict=False,
        )[0]
        target = FluxPipeline._pack_latents(noise - latents, b, c, h, w)
        return F.mse_loss(prediction.float(), target.float())


OBJECTIVES: dict[Family, type[Objective]] = {
    Family.SD: SDObjective,
    Family.SDXL: SDXLObjective,
    Family.FLUX: FluxObjective,
}


def objective_for(
    family: Family, model: str, guidance_scale: float = 3.5, settings: LossSettings = PLAIN_LOSS
) -> Objective:
    """The objective of `family` for the pipeline `model` (a local directory or a hub id)."""
    return OBJECTIVES[Family(family)](model, guidance_scale, settings)
