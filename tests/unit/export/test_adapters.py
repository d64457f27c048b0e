"""stk-export's LoRA formats read back by readers stk did not write: diffusers' `load_lora_weights` loads the kohya/
ComfyUI-key file through its own converters, and the denoiser then predicts what it predicts with the diffusers file.
SD3.5 is the one family diffusers has no converter of these keys for: its file is checked by its names and shapes.
An adapter that cannot be exported as it is (a damaged file, another family's, a NaN) is one line and no file."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.bad_inputs import DAMAGED_SAFETENSORS
from support.commands import one_error, stk_export
from support.lora_files import saved_lora
from support.tiny_batches import step_inputs

from stk.errors import CheckpointDamaged, ExitCode, InputError
from stk.export import ExportOptions, Format, export
from stk.models import Family, build_tiny_model
from stk.models.families import spec_for
from stk.train.objective.objectives import objective_for
from stk.train.trainable.lora import LORA_WEIGHTS, LoraSettings, add_lora, save_lora

# FLUX.1's reader (diffusers' _convert_kohya_flux_lora_to_diffusers) splits the single blocks' `linear1` at FLUX.1's
# published widths (3072, 12288), which a tiny transformer does not have: its LoRA is on the double blocks there.
DOUBLE_BLOCKS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_k",
    "transformer_blocks.0.attn.to_v",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.2",
    "ff_context.net.0.proj",
)
TARGETS: dict[Family, tuple[str, ...]] = {Family.FLUX: DOUBLE_BLOCKS, Family.CHROMA: DOUBLE_BLOCKS}
READ_BACK = [f for f in Family if f is not Family.SD3]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Any:
    built: dict[Family, str] = {}

    def get(family: Family) -> str:
        if family not in built:
            built[family] = build_tiny_model(family, str(tmp_path_factory.mktemp(family.value) / "model"))
        return built[family]

    return get


def lora_final(family: Family, model: str, out: Path, targets: tuple[str, ...] = ()) -> Path:
    """OUTPUT/final of a LoRA run, written as stk-train writes it (`save_lora`), its B not zero so that it counts."""
    spec = spec_for(family)
    denoiser = objective_for(family, model).load_denoiser(torch.float32)
    add_lora(denoiser, LoraSettings(rank=4, alpha=8, targets=targets or TARGETS.get(family, ())), family, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in denoiser.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(denoiser)
    save_lora(spec.pipeline_class, spec.denoiser.subfolder, denoiser.peft_config["default"], state, str(out))
    return out


def predicted(family: Family, model: str, lora: Path | None, weight_name: str = LORA_WEIGHTS) -> torch.Tensor:
    """The denoiser's prediction on a fixed batch, in the family's pipeline with `lora` loaded by load_lora_weights."""
    spec = spec_for(family)
    pipe = spec.pipeline_class.from_pretrained(model)
    if lora is not None:
        pipe.load_lora_weights(str(lora), weight_name=weight_name)
    inputs = step_inputs(family)
    times = torch.tensor([0.7, 0.3]) if spec.denoiser.flow else torch.tensor([700, 300])  # sigmas, or DDPM's timesteps
    with torch.no_grad():
        prediction: torch.Tensor = spec.denoiser.denoise(
            objective_for(family, model), getattr(pipe, spec.denoiser.subfolder), inputs.latents, times, inputs
        )
    return prediction


@pytest.mark.parametrize("family", READ_BACK, ids=lambda f: f.value)
def test_kohya_file_predicts_as_the_diffusers_file(models: Any, family: Family, tmp_path: Path) -> None:
    model = models(family)
    final = lora_final(family, model, tmp_path / "final")
    export(ExportOptions(str(final), str(tmp_path / "kohya.safetensors"), Format.KOHYA, family))
    keys = load_file(tmp_path / "kohya.safetensors").keys()
    kohya = family in (Family.SD, Family.SDXL, Family.ZIMAGE)
    assert all(k.startswith("lora_unet_" if kohya else "diffusion_model.") for k in keys)
    base = predicted(family, model, None)
    own = predicted(family, model, final)
    kohya = predicted(family, model, tmp_path, "kohya.safetensors")
    assert not torch.allclose(own, base, atol=1e-4)  # the adapter changes the prediction
    torch.testing.assert_close(kohya, own, rtol=1e-4, atol=1e-5)


def test_diffusers_format_is_the_file_itself(models: Any, tmp_path: Path) -> None:
    final = lora_final(Family.SD, models(Family.SD), tmp_path / "final")
    export(ExportOptions(str(final), str(tmp_path / "copy.safetensors"), family=Family.SD))
    assert (tmp_path / "copy.safetensors").read_bytes() == (final / LORA_WEIGHTS).read_bytes()


def test_sd3_names_are_the_mmdit_ones(models: Any, tmp_path: Path) -> None:
    """No diffusers reader: the names of Stability's MM-DiT, q, k and v fused block-diagonally."""
    final = lora_final(Family.SD3, models(Family.SD3), tmp_path / "final")
    export(ExportOptions(str(final), str(tmp_path / "k.safetensors"), Format.KOHYA, Family.SD3))
    tensors = load_file(tmp_path / "k.safetensors")
    own = load_file(final / LORA_WEIGHTS)
    qkv = "diffusion_model.joint_blocks.0.x_block.attn.qkv"
    assert {f"{qkv}.lora_down.weight", f"{qkv}.lora_up.weight", f"{qkv}.alpha"} <= tensors.keys()
    assert "diffusion_model.joint_blocks.0.context_block.attn.proj.lora_up.weight" in tensors
    down, up = tensors[f"{qkv}.lora_down.weight"], tensors[f"{qkv}.lora_up.weight"]
    scale = tensors[f"{qkv}.alpha"].item() / down.shape[0]
    parts = [own[f"transformer.transformer_blocks.0.attn.to_{c}.lora_{ab}.weight"] for c in "qkv" for ab in "BA"]
    expected = torch.cat([b @ a * 2.0 for b, a in zip(parts[0::2], parts[1::2], strict=True)])  # alpha 8 / rank 4
    torch.testing.assert_close(up @ down * scale, expected)


# --- adapters that cannot be exported as they are ---------------------------------------------------------------


@pytest.fixture(scope="module")
def sdxl_lora(sdxl: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SDXL LoRA's final/ as stk-train writes it; read-only: the tests damage copies of it."""
    final = tmp_path_factory.mktemp("sdxl-lora") / "final"
    saved_lora(Family.SDXL, str(sdxl), final)
    return final


@pytest.mark.parametrize(("damage", "says"), DAMAGED_SAFETENSORS)
def test_a_damaged_adapter_file_is_exit_6_naming_it(
    sdxl_lora: Path, tmp_path: Path, damage: Callable[[Path], None], says: str
) -> None:
    final = Path(shutil.copytree(sdxl_lora, tmp_path / "final"))
    damage(final / LORA_WEIGHTS)
    with pytest.raises(CheckpointDamaged, match=f"{LORA_WEIGHTS}: damaged, not a whole safetensors file .*{says}"):
        export(ExportOptions(str(final), str(tmp_path / "out.safetensors"), Format.KOHYA, Family.SDXL))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_another_familys_adapter_is_one_line_exit_3(sdxl_lora: Path, tmp_path: Path) -> None:
    """An SDXL LoRA given --family flux (a KeyError deep in the kohya layout before): its keys are a UNet's."""
    proc = stk_export(sdxl_lora, tmp_path / "out.safetensors", "--family", "flux", "--format", "kohya")
    one_error(proc, ExitCode.INPUT, "unet.", "is not a weight of Flux's transformer", "give its --family")
    assert not list(tmp_path.iterdir())


def test_an_adapter_holding_a_nan_is_refused_naming_the_tensor(sdxl_lora: Path, tmp_path: Path) -> None:
    final = Path(shutil.copytree(sdxl_lora, tmp_path / "final"))
    with safe_open(str(final / LORA_WEIGHTS), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(final / LORA_WEIGHTS)
    name = sorted(k for k in tensors if "lora_B" in k)[-1]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, final / LORA_WEIGHTS, metadata=metadata)
    for fmt in (Format.DIFFUSERS, Format.KOHYA):
        with pytest.raises(InputError, match=f"{name} holds NaN or infinite values: the training diverged"):
            export(ExportOptions(str(final), str(tmp_path / "out.safetensors"), fmt, Family.SDXL))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
