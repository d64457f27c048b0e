"""The training loss of each kind of family, written as diffusers' own training examples write it, so a fine-tune
learns what the family's pipeline will ask of it at inference: DDPM noise prediction (epsilon or v) or rectified
flow matching. The family's spec (stk.models.families) says which, and how its denoiser is called.

All randomness (noise, timesteps, sigmas) comes from the caller's CPU generator and is then moved to the latents'
device: a step is reproducible from its seed on any device and any number of ranks.
"""

from __future__ import annotations

import abc
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# Deep imports where the type matters: mypy resolves diffusers' lazy top-level names to placeholders.
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from stk.cluster.world import World
from stk.errors import InputError
from stk.models.components import load_component
from stk.models.families import Family, spec_for
from stk.models.interface import StepInputs
from stk.models.model_json import vae_scale_factor
from stk.models.weightfiles import component_folder, weight_files
from stk.train.objective.losses import LossSettings, flow_shift, min_snr_weights, offset_noise, sample_u
from stk.train.trainable.baseprecision import quantizer
from stk.train.trainable.weights import load_weights, load_weights_partitioned

__all__ = ["DDPMObjective", "FlowObjective", "Objective", "objective_for"]

PREDICTION_TYPES = ("epsilon", "v_prediction")
PLAIN_LOSS = LossSettings()  # frozen: plain MSE and the example's flow schedule


class Objective(abc.ABC):
    """One model family's denoiser and loss. Reads only configs when built; `load_denoiser` loads the weights."""

    def __init__(
        self, family: Family, model: str, guidance_scale: float = 3.5, settings: LossSettings = PLAIN_LOSS
    ) -> None:
        self.spec = spec_for(family)
        self.family = self.spec.name
        self.denoiser_subfolder: str = self.spec.denoiser.subfolder
        self.denoiser_class: type[Any] = self.spec.denoiser.model_class
        self.pipeline_class: type[Any] = self.spec.pipeline_class  # its save_lora_weights writes the LoRA format
        self.model = model  # local diffusers pipeline directory or hub id
        self.guidance_scale = guidance_scale  # only guidance-distilled models (Flux dev) use it
        self.settings = settings

    @cached_property
    def vae_scale_factor(self) -> int:
        """Pixels per latent, read from the VAE's config when a family's denoiser call first asks."""
        return vae_scale_factor(self.model)

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
        folder = component_folder(self.model, self.denoiser_subfolder)
        return weight_files(folder) if folder is not None else None

    def load_denoiser(
        self,
        dtype: torch.dtype,
        world: World | None = None,
        zero3_config: dict[str, Any] | None = None,
        base_precision: str = "bf16",
    ) -> torch.nn.Module:
        """The denoiser in `dtype`, in train mode with every parameter trainable, never more than once in memory
        (stk.train.trainable.weights), its linear layers quantised as they load with a `base_precision` of int8 or fp8
        (stk.train.trainable.baseprecision). With `world` and `zero3_config` (a ZeRO-3 run's DeepSpeed config) it is
        built partitioned across the ranks, and every rank must call this."""
        config = self.denoiser_config()
        files = self._weight_files()
        quantise = quantizer(base_precision)
        if files is None:  # no safetensors (.bin weights): diffusers' own loading, quantised once loaded
            module = load_component(
                self.denoiser_class.from_pretrained, self.model, self.denoiser_subfolder, dtype=dtype
            )
            for layer in module.modules() if quantise is not None else ():
                quantise(layer)
        elif world is not None and zero3_config is not None:
            module = load_weights_partitioned(self.denoiser_class, config, files, world, zero3_config)
        else:
            module = load_weights(self.denoiser_class, config, files, dtype, quantise)
        module.train()
        module.requires_grad_(True)
        return module

    @abc.abstractmethod
    def loss(self, denoiser: torch.nn.Module, inputs: StepInputs, generator: torch.Generator) -> torch.Tensor:
        """Scalar float32 MSE of one micro-batch. `denoiser` is the module or a DeepSpeed engine around it."""


class DDPMObjective(Objective):
    """DDPM noise prediction (epsilon or v), as in diffusers' train_text_to_image.py. The scheduler config the
    pipeline ships (PNDM, Euler, ...) holds the betas and prediction type the denoiser was trained with."""

    def __init__(
        self, family: Family, model: str, guidance_scale: float = 3.5, settings: LossSettings = PLAIN_LOSS
    ) -> None:
        super().__init__(family, model, guidance_scale, settings)
        self.scheduler = load_component(DDPMScheduler.from_pretrained, model, "scheduler")
        self.prediction_type = self.scheduler.config["prediction_type"]
        if self.prediction_type not in PREDICTION_TYPES:
            raise InputError(
                f"{model}/scheduler: prediction_type {self.prediction_type!r} cannot be trained; stk trains "
                + " or ".join(PREDICTION_TYPES)
            )

    def loss(self, denoiser: torch.nn.Module, inputs: StepInputs, generator: torch.Generator) -> torch.Tensor:
        latents = inputs.latents
        noise = randn_tensor(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
        if self.settings.noise_offset:
            noise = offset_noise(noise, self.settings.noise_offset, generator)
        steps = self.scheduler.config["num_train_timesteps"]
        timesteps = torch.randint(0, steps, (len(latents),), generator=generator).to(latents.device)
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        target = noise if self.prediction_type == "epsilon" else self.scheduler.get_velocity(latents, noise, timesteps)
        prediction = self.spec.denoiser.denoise(self, denoiser, noisy, timesteps, inputs)
        gamma = self.settings.snr_gamma
        if gamma is None:
            return F.mse_loss(prediction.float(), target.float())
        per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
        return (per_sample * min_snr_weights(self.scheduler, timesteps, gamma, self.prediction_type)).mean()


class FlowObjective(Objective):
    """Rectified flow matching as in diffusers' flow training examples (train_dreambooth_flux.py and the LoRA scripts
    of the newer families), the denoiser predicting noise - latents. Sigmas are drawn as the family's example draws
    them, or shifted as --flow-shift says (stk.train.objective.losses)."""

    def __init__(
        self, family: Family, model: str, guidance_scale: float = 3.5, settings: LossSettings = PLAIN_LOSS
    ) -> None:
        super().__init__(family, model, guidance_scale, settings)
        self.scheduler = load_component(FlowMatchEulerDiscreteScheduler.from_pretrained, model, "scheduler")
        self.sampling = settings.sampling(family)
        # the training table the examples index (`noise_scheduler_copy.timesteps`): made when the scheduler is, and
        # shifted then only by a static shift; set_timesteps, which inference calls, never runs on this copy
        self.table = self.scheduler.sigmas.clone()

    def sigmas(self, batch_size: int, image_seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """(batch_size,) float32 noise levels in (0, 1] on the CPU, for images of `image_seq_len` packed tokens:
        the example's `timesteps[(u * 1000).long()] / 1000`, or that table unshifted and shifted by --flow-shift."""
        u = sample_u(self.settings, self.sampling, batch_size, generator)
        steps = len(self.table)
        indices = (u * steps).long().clamp(max=steps - 1)  # a sigmoid rounded to 1.0 in float32 stays in the table
        shift = self.settings.flow_shift
        if shift == "example":
            return self.table[indices].float()
        unshifted = (steps - indices).float() / steps
        config = self.scheduler.config
        if shift != "auto":
            return flow_shift(unshifted, float(shift))
        if config["use_dynamic_shifting"]:
            shifted: torch.Tensor = self.scheduler.time_shift(
                self.spec.denoiser.inference_mu(config, image_seq_len), 1.0, unshifted
            )
            return shifted
        return flow_shift(unshifted, float(config["shift"]))

    def loss(self, denoiser: torch.nn.Module, inputs: StepInputs, generator: torch.Generator) -> torch.Tensor:
        latents = inputs.latents
        b, _, h, w = latents.shape
        patch = self.spec.latents.patch_size
        if h % patch or w % patch:
            raise ValueError(
                f"{self.spec.title} packs {patch}x{patch} latent patches: latent height and width must be multiples "
                f"of {patch}, got {h}x{w}"
            )
        device, dtype = latents.device, latents.dtype
        noise = randn_tensor(latents.shape, generator=generator, device=device, dtype=dtype)
        sigmas = self.sigmas(b, (h // patch) * (w // patch), generator).to(device, dtype)
        sigma = sigmas.view(b, 1, 1, 1)
        noisy = (1 - sigma) * latents + sigma * noise
        prediction = self.spec.denoiser.denoise(self, denoiser, noisy, sigmas, inputs)
        if self.spec.denoiser.precondition_outputs:  # the clean latents, predicted from the velocity, as their target
            return F.mse_loss((prediction * (-sigma) + noisy).float(), latents.float())
        target = self.spec.latents.pack(noise - latents)
        return F.mse_loss(prediction.float(), target.float())


def objective_for(
    family: Family, model: str, guidance_scale: float = 3.5, settings: LossSettings = PLAIN_LOSS
) -> Objective:
    """The objective of `family` for the pipeline `model` (a local directory or a hub id)."""
    kind = FlowObjective if spec_for(family).denoiser.flow else DDPMObjective
    return kind(family, model, guidance_scale, settings)
