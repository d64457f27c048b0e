"""The DeepSpeed engine around the denoiser, and the full weights back out of it at the end."""

from __future__ import annotations

from typing import Any

import torch

from stk.log import get_logger
from stk.train.dsconfig import builds_own_optimizer, training_config, zero_stage
from stk.train.optim import client_optimizer, lr_schedule, optimizer_section
from stk.train.options import TrainOptions

__all__ = ["build_engine", "full_state_dict"]

log = get_logger("train.engine")


def build_engine(
    denoiser: torch.nn.Module, opts: TrainOptions, base: dict[str, Any], precision: str, total_steps: int
) -> Any:
    """deepspeed.initialize with `base` (see dsconfig) and the run's optimizer, LR schedule and
    precision (and torch.compile)."""
    import deepspeed

    own = builds_own_optimizer(base)
    section = optimizer_section(opts.optimizer) if own else None
    config = training_config(base, opts.batch_size, opts.grad_accum, opts.max_grad_norm, precision, section)
    if not own:
        config["zero_allow_untested_optimizer"] = True  # Lion: ZeRO only partitions its state, as for Adam
    trainable = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = None if own else client_optimizer(trainable, opts.optimizer)
    engine, _, _, _ = deepspeed.initialize(
        model=denoiser,
        optimizer=optimizer,
        model_parameters=trainable if own else None,
        lr_scheduler=lr_schedule(opts.lr_schedule, opts.warmup_steps, total_steps),
        config=config,
    )
    log.info(
        "DeepSpeed ZeRO stage %d, %s, %s optimizer%s, %d trainable parameters",
        zero_stage(config),
        precision,
        opts.optimizer.name,
        " (DeepSpeed's, offloaded)" if own else "",
        sum(getattr(p, "ds_numel", p.numel()) for p in trainable),  # ZeRO-3 leaves p.numel() == 0
    )
    if opts.compile_mode:
        engine.compile(compile_kwargs={"mode": opts.compile_mode})
    return engine


def full_state_dict(engine: Any) -> dict[str, torch.Tensor] | None:
    """The denoiser's complete weights on rank 0's CPU (None elsewhere). Collective: under ZeRO-3
    the shards are gathered layer by layer so no GPU holds the whole model."""
    import torch.distributed as dist

    if engine.zero_optimization_partition_weights():
        state: dict[str, torch.Tensor] | None = engine._zero3_consolidated_16bit_state_dict()
        return state
    if dist.get_rank() != 0:
        return None
    return {name: tensor.detach().cpu() for name, tensor in engine.module.state_dict().items()}
