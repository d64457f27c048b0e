"""Everything a training run is set up with: what stk-train's options fill in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stk.models import Family
from stk.train.deepspeed.distributed import COLLECTIVE_TIMEOUT_S
from stk.train.deepspeed.optim import OptimizerSettings
from stk.train.objective.losses import LossSettings
from stk.train.trainable.lora import LoraSettings
from stk.train.validation.plan import ValidationSettings

__all__ = ["TrainOptions"]


@dataclass
class TrainOptions:
    model: str  # diffusers pipeline directory or hub id
    output_dir: str  # shared by every rank: checkpoints/, metrics.jsonl, final/
    cache: str | None = None  # stk-cache output (local or s3://); None with vae_on_the_fly
    scan: str | None = None  # stk-scan output: coverage check, repeats, and the images for vae_on_the_fly
    family: Family | None = None
    vae_on_the_fly: bool = False
    deepspeed: str = "zero2"  # preset name or JSON file
    precision: str | None = None  # bf16 | fp32; default bf16 on GPU, fp32 on CPU
    batch_size: int = 4  # per GPU
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps, as many epochs as they take; None: --epochs
    seed: int = 0
    repeats: int | None = None  # None: the scan's per-bucket repeats, else 1
    allow_oversubscription: bool = False
    guidance_scale: float = 3.5  # Flux models with a guidance embedding
    checkpoint_every: int = 500  # optimizer steps; 0: only on signals and at the end
    keep_checkpoints: int = 3
    resume: str = "auto"  # auto | none | a checkpoint directory (--resume-from)
    compile_mode: str | None = None  # torch.compile mode; None: eager
    gradient_checkpointing: bool = True  # recompute activations in the backward pass: less memory, same math
    lora: LoraSettings = field(default_factory=LoraSettings)  # rank 0: train every weight
    base_precision: str = "bf16"  # an adapter's frozen base: bf16 (the training dtype) | int8 | fp8 (baseprecision)
    fp8_matmuls: bool = False  # the repeated blocks' linear layers multiply in float8 (stk.train.trainable.fp8)
    loss: LossSettings = field(default_factory=LossSettings)  # min-SNR, noise offset, Flux timestep sampling
    validation: ValidationSettings = field(default_factory=ValidationSettings)  # the --validation-* options
    # 0: no EMA; else the decay of a sharded EMA of the trained weights (stk.train.trainable.ema)
    ema_decay: float = 0.0
    ema_every: int = 1  # optimizer steps between EMA updates
    local_cache_dir: str | None = None  # node-local directory for whole S3 shards
    local_cache_bytes: int | None = None
    check_shards: bool = True  # each shard's sha256 against the manifest before its first sample is used
    force: bool = False  # train on a cache made with other VAE / text-encoder weights than the model's
    loader_threads: int = 4
    prefetch: int = 8
    notify_urls: tuple[str, ...] = ()
    notify_config: str | None = None
    health_interval: float = 10.0
    max_nonfinite_steps: int = 3  # non-finite steps in a row a run rides through; one more stops it (exit 8)
    collective_timeout: float = COLLECTIVE_TIMEOUT_S  # seconds a rank waits for its peers in one collective
    override_resume: bool = False  # resume although run_settings differ from the checkpoint's
    report_to: str = "tensorboard"  # where rank 0 reports besides metrics.jsonl: tensorboard | wandb | none

    def run_settings(self, family: Family, world_size: int) -> dict[str, Any]:
        """What decides a run's math and sample order. A checkpoint records them: resuming with
        other values would silently train another run, or fail deep inside DeepSpeed. Length
        (--epochs, --max-steps) is not among them: extending a run is what resume is for. The
        world size is, with the batch: together they make the effective batch."""
        opt = self.optimizer
        return {
            "family": family.value,
            "seed": self.seed,
            "optimizer": opt.name,
            "lr": opt.lr,
            "betas": list(opt.betas),
            "weight_decay": opt.weight_decay,
            "lr_schedule": self.lr_schedule,
            "warmup_steps": self.warmup_steps,
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "world_size": world_size,
            **self.lora.run_settings(family),
            "base_precision": self.base_precision,
            "fp8_matmuls": self.fp8_matmuls,
            **self.loss.run_settings(family),
            "ema_decay": self.ema_decay,
            "ema_every": self.ema_every,
        }
