"""LoRA through peft, as diffusers' own training examples add it: the denoiser's weights frozen, low-rank adapters
on the layers the family's spec names (`FamilySpec.lora_targets`: the attention projections, and Flux's double
blocks' feed-forward layers) trained, and the adapters saved in the format `pipe.load_lora_weights` reads.

Under ZeRO-3 the adapter's parameters are partitioned like any other, so saving gathers them (and only them)
first; every rank takes part, rank 0 writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stk.errors import InputError
from stk.models.families import Family, spec_for
from stk.train.export import replaced_on_success

if TYPE_CHECKING:
    from stk.train.objectives import Objective

__all__ = [
    "LORA_WEIGHTS",
    "LoraSettings",
    "add_lora",
    "check_targets",
    "lora_state_dict",
    "save_lora",
]

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # the file name load_lora_weights looks for


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 0  # 0: full fine-tune
    alpha: int | None = None  # None: the rank (a scale of 1)
    dropout: float = 0.0
    targets: tuple[str, ...] = ()  # module names (or their last parts); empty: the family's lora_targets

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def check(self) -> None:
        """InputError for values no adapter can have; run before any model loads."""
        if self.rank < 0:
            raise InputError(f"--lora-rank {self.rank}: give a rank of at least 1, or 0 to train every weight")
        if self.alpha is not None and self.alpha <= 0:
            raise InputError(f"--lora-alpha {self.alpha}: give a positive number (default: the rank)")
        if not 0 <= self.dropout < 1:
            raise InputError(f"--lora-dropout {self.dropout}: give a probability in [0, 1)")

    @property
    def scale_alpha(self) -> int:
        """alpha as the adapter uses it: the adapter's output is scaled by alpha / rank."""
        return self.alpha or self.rank

    def targets_for(self, family: Family) -> tuple[str, ...]:
        return self.targets or spec_for(family).lora_targets

    def run_settings(self, family: Family) -> dict[str, Any]:
        """What a checkpoint records of the adapter: rank and targets decide which weights exist."""
        if not self.enabled:
            return {"lora_rank": 0}
        return {
            "lora_rank": self.rank,
            "lora_targets": sorted(self.targets_for(family)),
            "lora_alpha": self.scale_alpha,
            "lora_dropout": self.dropout,
        }

    def config(self, family: Family) -> Any:
        """The peft.LoraConfig: diffusers' examples' Gaussian A and zero B, so training starts at the base model."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.scale_alpha,
            lora_dropout=self.dropout,
            init_lora_weights="gaussian",
            target_modules=list(self.targets_for(family)),
        )


def _adaptable(module: torch.nn.Module) -> list[str]:
    """Names of the layers peft can put a LoRA on (linear and convolution)."""
    kinds = (torch.nn.Linear, torch.nn.Conv2d)
    return [name for name, layer in module.named_modules() if isinstance(layer, kinds)]


def _short_name(name: str) -> str:
    """The last part of a layer's name that a target can give: `to_q`, or `to_out.0` for a layer in a list."""
    parts = name.split(".")
    return ".".join(parts[-2:] if parts[-1].isdigit() and len(parts) > 1 else parts[-1:])


def check_targets(settings: LoraSettings, objective: Objective) -> None:
    """InputError when a target names no layer of the denoiser. The denoiser is built from its config on the meta
    device: no weights are read, so a typo costs a second, not a model load on every rank."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    if not settings.enabled:
        return
    with torch.device("meta"):
        denoiser = objective.denoiser_class.from_config(objective.denoiser_config())
    names = _adaptable(denoiser)
    missing = [
        target
        for target in settings.targets_for(objective.family)
        if not any(check_target_module_exists(LoraConfig(target_modules=[target]), name) for name in names)
    ]
    if missing:
        raise InputError(
            f"--lora-targets {','.join(missing)}: no such layer in the {objective.family.value} denoiser; "
            f"its linear and convolution layers end in: {', '.join(sorted({_short_name(n) for n in names}))}"
        )


def add_lora(denoiser: Any, settings: LoraSettings, family: Family, seed: int) -> int:
    """Freeze the denoiser and add the adapter, initialised from `seed` so that every rank starts from the same
    weights whatever its random state; returns the number of layers adapted. A target names the linear and
    convolution layers it ends (as `check_targets` reads it), never a list that holds some: one name can be a layer
    in one kind of block and a list in another, which peft would refuse."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import check_target_module_exists

    config = settings.config(family)
    config.target_modules = [name for name in _adaptable(denoiser) if check_target_module_exists(config, name)]
    denoiser.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        denoiser.add_adapter(config)
    return sum(isinstance(layer, LoraLayer) for layer in denoiser.modules())


def lora_state_dict(engine: Any) -> dict[str, torch.Tensor] | None:
    """The adapter's weights, in peft's names, on rank 0's CPU (None elsewhere). Collective: under ZeRO-3 only the
    adapter's parameters are gathered."""
    import deepspeed
    import torch.distributed as dist
    from peft.utils import get_peft_model_state_dict

    module = engine.module
    adapter = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    gather = engine.zero_optimization_partition_weights()
    with deepspeed.zero.GatheredParameters([p for _, p in adapter], modifier_rank=None, enabled=gather):
        if dist.get_rank() != 0:
            return None
        state = {name: p.detach().cpu().clone() for name, p in adapter}
    # assumes the one adapter add_lora made ("default"); peft drops that name from the keys
    result: dict[str, torch.Tensor] = get_peft_model_state_dict(module, state_dict=state)
    return result


def save_lora(
    pipeline_class: type[Any],
    denoiser_subfolder: str,
    adapter_config: Any,
    state: dict[str, torch.Tensor],
    out_dir: str,
) -> str:
    """Write `state` as OUT_DIR/pytorch_lora_weights.safetensors with the pipeline's own `save_lora_weights`, the
    adapter's config in its metadata so that alpha travels with it; returns out_dir. Rank 0 only.

    The metadata says dropout 0: dropout is for training, and `load_lora_weights` builds a loaded adapter's dropout
    layers in training mode, so a LoRA saved with its dropout would give noisy images in the user's pipeline."""
    metadata = {**adapter_config.to_dict(), "lora_dropout": 0.0}
    with replaced_on_success(out_dir) as tmp:
        pipeline_class.save_lora_weights(
            tmp,
            **{f"{denoiser_subfolder}_lora_layers": state, f"{denoiser_subfolder}_lora_adapter_metadata": metadata},
        )
    return out_dir
