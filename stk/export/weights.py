"""The pipeline a full fine-tune's weights make: OUTPUT/final as it is, or, from a checkpoint (DeepSpeed's ZeRO shards
of the denoiser alone), the fp32 weights DeepSpeed's own `zero_to_fp32` consolidates, put into `--model`'s pipeline
as stk-train's final/ is made (`stk.train.trainable.pipeline.export_pipeline`), in the export's scratch folder."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from stk.errors import CheckpointDamaged, InputError
from stk.export.source import Source
from stk.models.families import detect_family, spec_for

__all__ = ["pipeline_of"]


def pipeline_of(source: Source, model: str | None, scratch: Path) -> Path:
    """The diffusers pipeline folder of `source`'s full fine-tune; a checkpoint's is built in `scratch`."""
    if source.pipeline is not None:
        return source.pipeline
    if model is None:
        raise InputError(
            f"{source.path}: a full fine-tune's checkpoint holds the denoiser alone; give --model, the pipeline the "
            "run trained (its --model), for the other components"
        )
    from stk.train.trainable.pipeline import export_pipeline

    spec = spec_for(source.family)
    if (given := detect_family(model)) is not source.family:
        raise InputError(
            f"--model {model}: {spec_for(given).title}'s pipeline, but {source.path} trained {spec.title}'s "
            f"{spec.denoiser.subfolder}; give the --model the run trained"
        )
    config = dict(spec.denoiser.model_class.load_config(model, subfolder=spec.denoiser.subfolder))
    state = _weights_of(_consolidated(source.path), spec.denoiser.model_class, config, source.path)
    folder = scratch / "pipeline"
    export_pipeline(model, spec.denoiser.subfolder, spec.denoiser.model_class, config, state, str(folder))
    return folder


def _weights_of(
    state: dict[str, torch.Tensor], denoiser_class: Any, config: dict[str, Any], checkpoint: Path
) -> dict[str, torch.Tensor]:
    """The checkpoint's weights one per weight: a run's flat parameters (stk.train.trainable.flatweights) cut back into
    the weights of the denoiser `config` makes (built on the meta device: names and shapes only)."""
    from stk.train.trainable.flatweights import unflattened

    with torch.device("meta"):
        denoiser = denoiser_class.from_config(config)
    try:
        return unflattened(state, denoiser)
    except ValueError as exc:
        raise InputError(
            f"{checkpoint}: its weights do not fit --model's denoiser ({exc}); give the run's --model"
        ) from exc


def _consolidated(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The denoiser's fp32 weights from the checkpoint's ZeRO shards; CheckpointDamaged where DeepSpeed cannot read
    them (a checkpoint saved without digests, so not verified: a truncated or half-written file)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        state: dict[str, torch.Tensor] = get_fp32_state_dict_from_zero_checkpoint(
            str(checkpoint.parent), tag=checkpoint.name
        )
    except (RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointDamaged(f"{checkpoint}: DeepSpeed cannot read it ({line}); is the checkpoint whole?") from exc
    return state
