"""What a folder given to stk-export holds, as stk-train writes it: OUTPUT/final (the adapter's diffusers file, or
the whole pipeline of a full fine-tune), or a checkpoint (its stk-run.json; an adapter's checkpoint holds the adapter
as final/ does, in lora/; a full fine-tune's, DeepSpeed's shards of the denoiser)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from stk.errors import CheckpointDamaged, InputError
from stk.log import get_logger
from stk.models.families import Family, detect_family, family_hint, spec_for
from stk.train.checkpoint.digests import SETTINGS as RUN_SETTINGS
from stk.train.checkpoint.digests import damage_of

__all__ = ["Source", "check_whole", "read_source"]

log = get_logger("export")

ADAPTER_FILE = "pytorch_lora_weights.safetensors"  # stk.train.trainable.lora.LORA_WEIGHTS: what save_lora writes
PEFT_FILE = "adapter_model.safetensors"  # peft's: what stk.train.trainable.lora.save_peft writes for LoHa and LoKr
CHECKPOINT_ADAPTER = "lora"  # the adapter's folder in a checkpoint (stk.train.trainable.kinds.LoraAdapter.save_beside)


@dataclass(frozen=True)
class Source:
    path: Path
    family: Family
    adapter: Path | None  # the adapter's diffusers file; None for a full fine-tune
    pipeline: Path | None  # the diffusers pipeline folder of a full fine-tune's final/; None for its checkpoint


def _family_of_run(checkpoint: Path) -> Family | None:
    """The family a checkpoint's stk-run.json records, or None where it has none."""
    try:
        settings = json.loads((checkpoint / RUN_SETTINGS).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{checkpoint / RUN_SETTINGS}: cannot be read ({exc}); is the checkpoint complete?") from exc
    family = settings.get("family")
    return Family(family) if family in {f.value for f in Family} else None


def _family_beside(final: Path) -> Family | None:
    """A final/'s family from its run's latest checkpoint (OUTPUT/checkpoints/latest names it), where there is one."""
    checkpoints = final.parent / "checkpoints"
    try:
        tag = (checkpoints / "latest").read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return _family_of_run(checkpoints / tag) if (checkpoints / tag / RUN_SETTINGS).is_file() else None


def read_source(path: str, family: Family | None) -> Source:
    """The folder `path` as stk-export reads it; InputError (exit 3) for a folder that is neither a final/ nor a
    checkpoint, for an adapter whose family neither `family` nor its run's checkpoints tell, and for a `family` that
    the folder's own record contradicts; CheckpointDamaged (exit 6) for a checkpoint that does not verify and a
    final/ pipeline's weights file that is not whole."""
    folder = Path(path)
    if not folder.is_dir():
        raise InputError(f"{path}: no such folder; give stk-train's OUTPUT/final or a checkpoint folder")
    if (folder / "model_index.json").is_file():
        check_whole(sorted(folder.rglob("*.safetensors")))
        return Source(folder, _pipeline_family(folder, family), adapter=None, pipeline=folder)
    if (folder / RUN_SETTINGS).is_file():
        _verify(folder)
        recorded = _family_of_run(folder)
        if family is not None and recorded is not None and family is not recorded:
            raise InputError(
                f"{folder}: the checkpoint trained {recorded.value} (its {RUN_SETTINGS}), not --family "
                f"{family.value}; leave --family out"
            )
        file = _adapter_file(folder / CHECKPOINT_ADAPTER)
        return Source(folder, _known(folder, family or recorded), adapter=file, pipeline=None)
    file = _adapter_file(folder)
    if file is not None:
        return Source(folder, _known(folder, family or _family_beside(folder)), adapter=file, pipeline=None)
    raise InputError(
        f"{path}: not an stk-train final/ or checkpoint (no model_index.json, {ADAPTER_FILE} or {RUN_SETTINGS})"
    )


def _pipeline_family(folder: Path, given: Family | None) -> Family:
    """A final/ pipeline's family, from the pipeline its model_index.json names: `given` (--family) where stk does not
    know that pipeline, refused where it is another family (the weights are laid out for the pipeline's)."""
    try:
        detected = detect_family(str(folder))
    except InputError:
        if given is None:
            raise
        return given
    if given is not None and given is not detected:
        raise InputError(
            f"{folder}: holds {spec_for(detected).title}'s pipeline (its model_index.json), not --family "
            f"{given.value}'s; leave --family out"
        )
    return detected


def check_whole(files: Iterable[Path]) -> None:
    """CheckpointDamaged naming the first of `files` that is not whole safetensors (truncated, its header overwritten):
    safetensors reads the header and checks that the tensors cover the rest of the file, without reading them."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except SafetensorError as exc:
            raise CheckpointDamaged(f"{file}: damaged, not a whole safetensors file ({exc})") from exc


def _verify(checkpoint: Path) -> None:
    """The checkpoint's files against the sha256 of its record, as a resume checks them (stk.train.checkpoint.store)."""
    found = damage_of(str(checkpoint))
    if found is None:
        log.warning(
            "checkpoint %s records no digests (saved by an older stk): exported without verifying it", checkpoint
        )
    elif found:
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        raise CheckpointDamaged(
            f"{checkpoint}: the checkpoint is damaged ({found[0]}{more}); export another checkpoint of the run, or "
            "restore these files"
        )


def _adapter_file(folder: Path) -> Path | None:
    """The adapter's file in `folder`: diffusers' (LoRA, DoRA) or peft's (LoHa, LoKr); None where neither is."""
    return next((folder / name for name in (ADAPTER_FILE, PEFT_FILE) if (folder / name).is_file()), None)


def _known(folder: Path, family: Family | None) -> Family:
    if family is None:
        raise InputError(f"{folder}: the model's family is not recorded beside it; {family_hint()}")
    return family
