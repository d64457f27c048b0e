"""The DeepSpeed engine around the denoiser, and the full weights back out of it at the end."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from stk.log import get_logger
from stk.train.deepspeed.config import builds_own_optimizer, training_config, zero_stage
from stk.train.deepspeed.optim import client_optimizer, lr_schedule, optimizer_section
from stk.train.options import TrainOptions
from stk.train.trainable.compiled import compile_blocks
from stk.train.trainable.flatweights import FLAT, FlatWeights

__all__ = ["build_engine", "engine_config", "full_state_dict"]

log = get_logger("train.engine")


def engine_config(
    opts: TrainOptions, base: dict[str, Any], precision: str, load_universal: bool = False
) -> dict[str, Any]:
    """The DeepSpeed config of this run: `base` (see dsconfig) with its batch, clipping, precision and optimizer;
    `load_universal` to resume from a universal checkpoint (stk.train.checkpoint.worldsize)."""
    own = builds_own_optimizer(base)
    section = optimizer_section(opts.optimizer) if own else None
    config = training_config(base, opts.batch_size, opts.grad_accum, opts.max_grad_norm, precision, section)
    if not own:
        config["zero_allow_untested_optimizer"] = True  # Lion: ZeRO only partitions its state, as for Adam
    if load_universal:
        config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
    return config


def build_engine(
    denoiser: torch.nn.Module,
    opts: TrainOptions,
    config: dict[str, Any],
    precision: str,
    total_steps: int,
    layout: str = FLAT,
) -> Any:
    """deepspeed.initialize with `config` (engine_config) and the run's optimizer and LR schedule (and
    its blocks compiled, stk.train.trainable.compiled), the trainable weights in `layout`
    (stk.train.trainable.flatweights.layout_for)."""
    import deepspeed

    if opts.gradient_checkpointing:  # before DeepSpeed wraps the module and compile traces it
        denoiser.enable_gradient_checkpointing()  # type: ignore[operator]  # every diffusers denoiser has it
    own = builds_own_optimizer(config)
    trainable = [p for p in denoiser.parameters() if p.requires_grad]
    flat = FlatWeights(denoiser) if layout == FLAT and zero_stage(config) < 3 else None
    with flat.registered() if flat is not None else nullcontext(trainable) as owned:
        optimizer = None if own else client_optimizer(owned, opts.optimizer)
        engine, _, _, _ = deepspeed.initialize(
            model=denoiser,
            optimizer=optimizer,
            model_parameters=owned if own else None,
            lr_scheduler=lr_schedule(opts.lr_schedule, opts.warmup_steps, total_steps),
            config=config,
        )
    if flat is not None:
        flat.bind()
    log.info(
        "DeepSpeed ZeRO stage %d, %s, %s optimizer%s, %d trainable parameters (%s), gradient checkpointing %s",
        zero_stage(config),
        precision,
        opts.optimizer.name,
        " (DeepSpeed's, offloaded)" if own else "",
        sum(getattr(p, "ds_numel", p.numel()) for p in trainable),  # ZeRO-3 leaves p.numel() == 0
        f"{len(flat.flats)} flat, one per block" if flat is not None else "one DeepSpeed parameter per weight",
        "on" if opts.gradient_checkpointing else "off",
    )
    if opts.compile_mode:
        compile_blocks(engine.module, opts.compile_mode, opts.output_dir)
    return engine


def full_state_dict(engine: Any) -> dict[str, torch.Tensor] | None:
    """The denoiser's complete weights on rank 0's CPU (None elsewhere). Collective: under ZeRO-3
    the shards are gathered layer by layer so no GPU holds the whole model."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if engine.zero_optimization_partition_weights():
        return _gathered_state_dict(engine.module, rank)
    if rank != 0:
        return None
    return {name: tensor.detach().cpu() for name, tensor in engine.module.state_dict().items()}


def _gathered_state_dict(module: torch.nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    """ZeRO-3's partitioned weights as `module.state_dict()` would hold them whole: each layer's
    parameters gathered in turn (deepspeed.zero.GatheredParameters, on every rank) and copied to
    rank 0's CPU before the next; a weight shared by two layers stays one tensor."""
    import deepspeed

    keys = set(module.state_dict(keep_vars=True))  # names only; persistent buffers, tied weights
    state: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}  # id(parameter) -> its CPU copy
    for prefix, layer in module.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        params = list(layer.named_parameters(recurse=False))
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):  # read only
            if rank != 0:
                continue
            for name, param in params:
                if id(param) not in copies:
                    copies[id(param)] = param.detach().cpu()
                state[prefix + name] = copies[id(param)]
            for name, buffer in layer.named_buffers(recurse=False):
                if prefix + name in keys:
                    state[prefix + name] = buffer.detach().cpu()
    return state if rank == 0 else None
