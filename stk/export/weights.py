"""The pipeline a full fine-tune's weights make: OUTPUT/final as it is, or, from a checkpoint (DeepSpeed's ZeRO shards
of the denoiser alone), the fp32 weights DeepSpeed's own `zero_to_fp32` consolidates, put into `--model`'s pipeline
as stk-train's final/ is made (`stk.train.export.export_pipeline`), in a folder that lasts as long as the export."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stk.errors import InputError
from stk.export.source import Source
from stk.models.families import spec_for

__all__ = ["pipeline_of"]


@contextmanager
def pipeline_of(source: Source, model: str | None, scratch: Path) -> Iterator[Path]:
    """The diffusers pipeline folder of `source`'s full fine-tune; a checkpoint's is built under `scratch`."""
    if source.pipeline is not None:
        yield source.pipeline
        return
    if model is None:
        raise InputError(
            f"{source.path}: a full fine-tune's checkpoint holds the denoiser alone; give --model, the pipeline the "
            "run trained (its --model), for the other components"
        )
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from stk.train.export import export_pipeline

    spec = spec_for(source.family)
    state = get_fp32_state_dict_from_zero_checkpoint(str(source.path.parent), tag=source.path.name)
    config = dict(spec.denoiser_class.load_config(model, subfolder=spec.denoiser_subfolder))
    with tempfile.TemporaryDirectory(prefix=".stk-export-", dir=scratch) as tmp:
        folder = Path(tmp) / "pipeline"
        export_pipeline(model, spec.denoiser_subfolder, spec.denoiser_class, config, state, str(folder))
        yield folder
