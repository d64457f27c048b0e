"""LoRA through peft, as diffusers' own training examples add it: the denoiser's weights frozen, low-rank adapters
on the layers the family's spec names (`FamilySpec.denoiser.lora_targets`: the attention projections, and Flux's double
blocks' feed-forward layers) trained, and the adapters saved in the format `pipe.load_lora_weights` reads. The
LyCORIS adapters, LoHa and LoKr, and DoRA come from peft too (LoHaConfig, LoKrConfig, LoraConfig(use_dora=True)) on
the same targets; LoHa and LoKr are saved in peft's own format (`save_peft`), which load_lora_weights does not read.

Under ZeRO-3 the adapter's parameters are partitioned like any other, so saving gathers them (and only them)
first; every rank takes part, rank 0 writes. LoHa, LoKr and DoRA read weights outside the forward of the module
that holds them (the base layer's shape or norm, their own factors), so under ZeRO-3 each adapted layer gathers all
of its weights for its whole forward (`add_lora`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stk.errors import InputError
from stk.models.families import Family, spec_for
from stk.train.trainable.pipeline import replaced_on_success

if TYPE_CHECKING:
    from stk.train.objective.objectives import Objective

__all__ = [
    "ADAPTERS",
    "LORA_WEIGHTS",
    "LoraSettings",
    "add_lora",
    "check_targets",
    "lora_state_dict",
    "save_lora",
    "save_peft",
]

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # the file name load_lora_weights looks for
ADAPTERS = ("lora", "loha", "lokr")
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before each module name


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 0  # 0: full fine-tune
    alpha: int | None = None  # None: the rank (a scale of 1)
    dropout: float = 0.0
    targets: tuple[str, ...] = ()  # module names (or their last parts); empty: the family's lora_targets
    adapter: str = "lora"  # one of ADAPTERS: peft's LoraConfig, LoHaConfig, LoKrConfig
    dora: bool = False  # LoRA only: DoRA, the weight's magnitude trained apart from its direction (use_dora)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def reads_base_weight(self) -> bool:
        """Whether the adapter reads weights outside the forward of the module that holds them (LoHa and LoKr the base
        weight's shape and their factors, DoRA the base weight's norm and lora_A's shape): under ZeRO-3 the adapted
        layer's weights must then stay gathered for its whole forward."""
        return self.adapter != "lora" or self.dora

    @property
    def name(self) -> str:
        """How the log and the errors name it: LoRA, DoRA, LoHa, LoKr."""
        return "DoRA" if self.dora else {"lora": "LoRA", "loha": "LoHa", "lokr": "LoKr"}[self.adapter]

    def check(self) -> None:
        """InputError for values no adapter can have; run before any model loads."""
        if self.rank < 0:
            raise InputError(f"--lora-rank {self.rank}: give a rank of at least 1, or 0 to train every weight")
        if self.alpha is not None and self.alpha <= 0:
            raise InputError(f"--lora-alpha {self.alpha}: give a positive number (default: the rank)")
        if not 0 <= self.dropout < 1:
            raise InputError(f"--lora-dropout {self.dropout}: give a probability in [0, 1)")
        if self.adapter not in ADAPTERS:
            raise InputError(f"--adapter {self.adapter}: give one of {', '.join(ADAPTERS)}")
        if self.dora and self.adapter != "lora":
            raise InputError(f"--dora with --adapter {self.adapter}: DoRA is a kind of LoRA; drop one of them")
        if not self.enabled and (self.dora or self.adapter != "lora"):
            raise InputError(
                f"--adapter {self.adapter}{' --dora' if self.dora else ''}: give --lora-rank (at least "
                "1); rank 0 trains every weight"
            )

    @property
    def scale_alpha(self) -> int:
        """alpha as the adapter uses it: the adapter's output is scaled by alpha / rank."""
        return self.alpha or self.rank

    def targets_for(self, family: Family) -> tuple[str, ...]:
        return self.targets or spec_for(family).denoiser.lora_targets

    def run_settings(self, family: Family) -> dict[str, Any]:
        """What a checkpoint records of the adapter: its kind, rank and targets decide which weights exist."""
        if not self.enabled:
            return {"lora_rank": 0}
        return {
            "adapter": self.adapter,
            "dora": self.dora,
            "lora_rank": self.rank,
            "lora_targets": sorted(self.targets_for(family)),
            "lora_alpha": self.scale_alpha,
            "lora_dropout": self.dropout,
        }

    def config(self, family: Family) -> Any:
        """The peft config. LoRA (and DoRA): diffusers' examples' Gaussian A and zero B. LoHa and LoKr: peft's own
        initialisation, one factor zero. Either way training starts at the base model. LoHa and LoKr have no dropout
        on the input: --lora-dropout is their rank dropout, rows of the weight update dropped while training."""
        from peft import LoHaConfig, LoKrConfig, LoraConfig

        targets = list(self.targets_for(family))
        if self.adapter == "lora":
            return LoraConfig(
                r=self.rank,
                lora_alpha=self.scale_alpha,
                lora_dropout=self.dropout,
                init_lora_weights="gaussian",
                target_modules=targets,
                use_dora=self.dora,
            )
        kind = LoHaConfig if self.adapter == "loha" else LoKrConfig
        return kind(r=self.rank, alpha=self.scale_alpha, rank_dropout=self.dropout, target_modules=targets)


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
    from peft.tuners.tuners_utils import BaseTunerLayer, check_target_module_exists

    config = settings.config(family)
    modules = dict(denoiser.named_modules())
    config.target_modules = [name for name in _adaptable(denoiser) if check_target_module_exists(config, name)]
    denoiser.requires_grad_(False)
    partitioned = any(hasattr(p, "ds_id") for p in denoiser.parameters())  # built under ZeRO-3's zero.Init
    reads = partitioned and settings.reads_base_weight
    whole = [modules[name].weight for name in config.target_modules] if reads else []
    with torch.random.fork_rng(devices=[]), _gathered(whole):
        torch.manual_seed(seed)
        denoiser.add_adapter(config)
    modules_now: list[torch.nn.Module] = list(denoiser.modules())
    layers = [layer for layer in modules_now if isinstance(layer, BaseTunerLayer)]
    if whole:
        import deepspeed

        for layer in layers:  # the base layer's weights and the adapter's, read by the adapted layer's own forward
            for param in layer.parameters():
                deepspeed.zero.register_external_parameter(layer, param)
    return len(layers)


@contextmanager
def _gathered(weights: list[torch.nn.Parameter]) -> Iterator[None]:
    """ZeRO-3's partitioned `weights` whole on every rank while peft sizes the adapter from them (LoHa) or takes
    their norm (DoRA); nothing without weights."""
    if not weights:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(weights, modifier_rank=None):
        yield


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
    # assumes the one adapter add_lora made ("default"); peft drops that name from the keys (and names DoRA's
    # magnitude `lora_magnitude_vector`, as load_lora_weights reads it)
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


def save_peft(adapter_config: Any, state: dict[str, torch.Tensor], out_dir: str) -> str:
    """Write `state` as `PeftModel.save_pretrained` does: OUT_DIR/adapter_config.json and adapter_model.safetensors
    with peft's key names, for `PeftModel.from_pretrained(denoiser, out_dir)` or `set_peft_model_state_dict` on a
    denoiser given the config (peft drops the prefix there); returns out_dir. Rank 0 only. The format of LoHa and
    LoKr, which diffusers' load_lora_weights does not read."""
    from peft.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    config = copy.copy(adapter_config)
    config.inference_mode = True  # as save_pretrained records it: the rank dropout is for training only
    with replaced_on_success(out_dir) as tmp:
        config.save_pretrained(tmp)
        weights = {f"{PEFT_PREFIX}{name}": tensor.contiguous() for name, tensor in state.items()}
        save_file(weights, os.path.join(tmp, SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    return out_dir
