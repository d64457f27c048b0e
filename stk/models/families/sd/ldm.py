"""The LDM (CompVis / Stability) single-file layout of SD and SDXL: the UNet under `model.diffusion_model.`, the VAE
under `first_stage_model.`, the text encoders under their own prefixes, as `from_single_file`, ComfyUI and A1111 read
it. diffusers ships the reverse (`single_file_utils.convert_ldm_*`) and its fixed names (`DIFFUSERS_TO_LDM_MAPPING`);
the block prefixes are worked out here from the components' configs, as diffusers' readers work them out, so any
UNet or VAE depth converts (the published ones and the tiny ones alike)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING as _MAPPING

from stk.models.layouts import read_component

__all__ = ["ldm_checkpoint", "ldm_unet", "ldm_vae", "open_clip"]

UNET = "model.diffusion_model."
VAE = "first_stage_model."
MAPPING: dict[str, Any] = _MAPPING  # diffusers' fixed names, diffusers -> LDM, per component
RESNET = (
    ("norm1", "in_layers.0"),
    ("conv1", "in_layers.2"),
    ("norm2", "out_layers.0"),
    ("conv2", "out_layers.3"),
    ("time_emb_proj", "emb_layers.1"),
    ("conv_shortcut", "skip_connection"),
)
VAE_ATTENTION = (
    ("group_norm.", "norm."),
    ("to_q.", "q."),
    ("to_k.", "k."),
    ("to_v.", "v."),
    ("to_out.0.", "proj_out."),
)


def _unet_blocks(config: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(diffusers prefix, LDM prefix) of every block of a UNet2DConditionModel, as convert_ldm_unet_checkpoint
    numbers them: input_blocks count resnets and downsamplers, output_blocks count layers_per_block + 1 per level."""
    per = int(config["layers_per_block"])
    levels = len(config["block_out_channels"])
    for i in range(levels):
        attention = "CrossAttn" in config["down_block_types"][i]
        for j in range(per):
            yield f"down_blocks.{i}.resnets.{j}.", f"input_blocks.{(per + 1) * i + j + 1}.0."
            if attention:
                yield f"down_blocks.{i}.attentions.{j}.", f"input_blocks.{(per + 1) * i + j + 1}.1."
        if i < levels - 1:
            yield f"down_blocks.{i}.downsamplers.0.conv.", f"input_blocks.{(per + 1) * (i + 1)}.0.op."
        attention = "CrossAttn" in config["up_block_types"][i]
        for j in range(per + 1):
            yield f"up_blocks.{i}.resnets.{j}.", f"output_blocks.{(per + 1) * i + j}.0."
            if attention:
                yield f"up_blocks.{i}.attentions.{j}.", f"output_blocks.{(per + 1) * i + j}.1."
        if i < levels - 1:
            yield f"up_blocks.{i}.upsamplers.0.", f"output_blocks.{(per + 1) * i + per}.{2 if attention else 1}."
    yield "mid_block.attentions.0.", "middle_block.1."
    for j in range(2):
        yield f"mid_block.resnets.{j}.", f"middle_block.{2 * j}."


def _replace(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for old, new in pairs:
        name = name.replace(old, new)
    return name


def _split(key: str, blocks: list[tuple[str, str]], what: str) -> tuple[str, str, str]:
    """(diffusers prefix, LDM prefix, the rest) of a key inside one of `blocks`."""
    for prefix, ldm in blocks:
        if key.startswith(prefix):
            return prefix, ldm, key[len(prefix) :]
    raise ValueError(f"{what}: {key} has no LDM name")


# (the block's diffusers prefix, the rest of the key, the weight) -> the rest and the weight as LDM has them
Inside = Callable[[str, str, torch.Tensor], tuple[str, torch.Tensor]]


def _ldm_names(
    state: dict[str, torch.Tensor], fixed: dict[str, str], blocks: list[tuple[str, str]], what: str, inside: Inside
) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        name = fixed.get(key)
        if name is None:
            prefix, ldm, rest = _split(key, blocks, what)
            rest, value = inside(prefix, rest, value)
            name = ldm + rest
        out[name] = value
    return out


def _unet_inside(prefix: str, rest: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
    return (_replace(rest, RESNET) if ".resnets." in prefix else rest), value


def ldm_unet(config: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The UNet's weights under their LDM names."""
    fixed = {**MAPPING["unet"]["layers"], **MAPPING["unet"]["addition_embed_type"]}
    named = _ldm_names(state, fixed, list(_unet_blocks(config)), "unet", _unet_inside)
    return {UNET + name: value for name, value in named.items()}


def _vae_blocks(config: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(diffusers prefix, LDM prefix) of the VAE's blocks: the decoder's levels are numbered the other way."""
    levels = len(config["block_out_channels"])
    per = int(config["layers_per_block"])
    for i in range(levels):
        for j in range(per):
            yield f"encoder.down_blocks.{i}.resnets.{j}.", f"encoder.down.{i}.block.{j}."
        yield f"encoder.down_blocks.{i}.downsamplers.0.", f"encoder.down.{i}.downsample."
        for j in range(per + 1):
            yield f"decoder.up_blocks.{i}.resnets.{j}.", f"decoder.up.{levels - 1 - i}.block.{j}."
        yield f"decoder.up_blocks.{i}.upsamplers.0.", f"decoder.up.{levels - 1 - i}.upsample."
    for part in ("encoder", "decoder"):
        yield f"{part}.mid_block.attentions.0.", f"{part}.mid.attn_1."
        for j in range(2):
            yield f"{part}.mid_block.resnets.{j}.", f"{part}.mid.block_{j + 1}."


def _vae_inside(prefix: str, rest: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The mid-block attention's linear weights as the 1x1 convolutions the LDM VAE has."""
    rest = rest.replace("conv_shortcut", "nin_shortcut")
    if prefix.endswith("attentions.0."):
        return _replace(rest, VAE_ATTENTION), value.reshape(*value.shape, 1, 1) if value.ndim == 2 else value
    return rest, value


def ldm_vae(config: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The VAE's weights under their LDM names."""
    named = _ldm_names(state, MAPPING["vae"], list(_vae_blocks(config)), "vae", _vae_inside)
    return {VAE + name: value for name, value in named.items()}


def open_clip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A CLIPTextModelWithProjection's weights in OpenCLIP's layout (SDXL's second text encoder): q, k and v in one
    `in_proj`, the projection transposed, as `convert_open_clip_checkpoint` splits them again."""
    names = MAPPING["openclip"]
    inner = tuple((old, new) for old, new in names["transformer"].items() if not old.startswith("transformer."))
    out = {prefix + ldm: state[key] for key, ldm in names["layers"].items() if key in state}
    out[prefix + "text_projection"] = out[prefix + "text_projection"].T.contiguous()
    for key, value in state.items():
        if key in names["layers"] or key.endswith("position_ids"):
            continue
        for code in ("q", "k", "v"):
            if f".self_attn.{code}_proj." in key:
                break
        else:
            out[prefix + "transformer." + _replace(key, inner)] = value
            continue
        if code == "q":
            base, kind = key.rsplit(".q_proj.", 1)
            fused = torch.cat([state[f"{base}.{c}_proj.{kind}"] for c in ("q", "k", "v")])
            out[prefix + "transformer." + _replace(base, inner) + f".in_proj_{kind}"] = fused
    return out


def _text_encoder(folder: Path) -> dict[str, torch.Tensor]:
    """A CLIP text encoder's weights under the names of transformers' wrapped CLIPTextModel (`text_model.…`), which
    LDM checkpoints hold; transformers 5.6 flattened the class, and its files name them without `text_model.`."""
    own = ("text_model.", "text_projection.")
    return {
        key if key.startswith(own) else "text_model." + key: value
        for key, value in read_component(folder)[1].items()
        if not key.endswith("position_ids")
    }


def ldm_checkpoint(folder: Path, text_encoders: dict[str, str], open_clip_encoders: dict[str, str]) -> dict[str, Any]:
    """The pipeline in `folder` as one LDM state dict: the UNet, the VAE, and each text encoder under its prefix
    (`text_encoders`: subfolder -> prefix, weights under transformers' names; `open_clip_encoders`: converted)."""
    out: dict[str, Any] = {}
    out.update(ldm_unet(*read_component(folder / "unet")))
    out.update(ldm_vae(*read_component(folder / "vae")))
    for subfolder, prefix in text_encoders.items():
        out.update({prefix + key: value for key, value in _text_encoder(folder / subfolder).items()})
    for subfolder, prefix in open_clip_encoders.items():
        out.update(open_clip(_text_encoder(folder / subfolder), prefix))
    return out
