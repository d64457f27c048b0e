"""Key layouts other tools read: what every family's conversions to them share. A family's own names live in its
folder (stk/models/families/<name>/, `FamilySpec.export`); here are the pieces: one adapted layer as kohya stores it,
several adapted layers fused into the one layer an original checkpoint has, and renames by prefix."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stk.errors import InputError

__all__ = [
    "DIFFUSION_MODEL",
    "Blocks",
    "Fuse",
    "KohyaLora",
    "LoraLayer",
    "block_layout",
    "block_weights",
    "fused",
    "kohya_entries",
    "peft_entries",
    "prefixed",
    "read_component",
    "renamed",
]

DIFFUSION_MODEL = "diffusion_model."  # ComfyUI's prefix for a DiT's own layer names


@dataclass(frozen=True)
class LoraLayer:
    """One adapted layer: `up @ down * scale` is what it adds to the layer's weight."""

    down: torch.Tensor  # (rank, in): peft's lora_A, kohya's lora_down
    up: torch.Tensor  # (out, rank): peft's lora_B, kohya's lora_up
    scale: float  # alpha / rank

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


# A family's conversion: the adapted layers by the denoiser's module name -> the tensors of the kohya/ComfyUI file.
KohyaLora = Callable[[Mapping[str, LoraLayer]], dict[str, torch.Tensor]]


def kohya_entries(name: str, layer: LoraLayer) -> dict[str, torch.Tensor]:
    """The three tensors kohya's format holds per layer; its alpha is scale x rank, as readers divide by the rank."""
    return {
        f"{name}.lora_down.weight": layer.down.contiguous(),
        f"{name}.lora_up.weight": layer.up.contiguous(),
        f"{name}.alpha": torch.tensor(layer.scale * layer.rank, dtype=torch.float32),
    }


def peft_entries(name: str, layer: LoraLayer) -> dict[str, torch.Tensor]:
    """peft's two tensors per layer with the scale folded into lora_A: for readers that take no alpha (ai-toolkit's
    `diffusion_model.` files, as diffusers reads FLUX.2's)."""
    return {
        f"{name}.lora_A.weight": (layer.down * layer.scale).contiguous(),
        f"{name}.lora_B.weight": layer.up.contiguous(),
    }


Entries = Callable[[str, LoraLayer], dict[str, torch.Tensor]]


def fused(parts: list[LoraLayer | None], widths: list[int]) -> LoraLayer:
    """The adapter of a layer that is several of diffusers' layers stacked by output rows (FLUX's `qkv`): the downs
    stacked, the ups block-diagonal, each part's scale moved into its down. A part that is None (not adapted) adds
    `width` rows of zeros, so the fused layer's rows still line up with the original weight's."""
    present = [part for part in parts if part is not None]
    if not present:
        raise ValueError("fused: no adapted part")
    like = present[0].up
    downs = [part.down * part.scale for part in present]
    ups = [
        part.up if part is not None else like.new_zeros((width, 0)) for part, width in zip(parts, widths, strict=True)
    ]
    return LoraLayer(down=torch.cat(downs), up=torch.block_diag(*ups), scale=1.0)


def renamed(name: str, prefixes: Iterable[tuple[str, str]]) -> str:
    """`name` with the first matching (old, new) prefix replaced; InputError where none matches."""
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old) :]
    raise _no_name(name)


def prefixed(prefix: str, dots: bool = True) -> KohyaLora:
    """A family whose original layer names are diffusers' own: each layer under `prefix` (with `_` for `.` where
    `dots` is False, as kohya's `lora_unet_` names are)."""

    def convert(layers: Mapping[str, LoraLayer]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, layer in layers.items():
            out.update(kohya_entries(prefix + (name if dots else name.replace(".", "_")), layer))
        return out

    return convert


@dataclass(frozen=True)
class Fuse:
    """One layer of the original model that is several of diffusers' (FLUX's `img_attn.qkv`: `attn.to_q`,
    `attn.to_k`, `attn.to_v`), stacked by output rows; `units` are their heights in a common unit (FLUX's single
    blocks' `linear1`: q, k, v and an MLP four times as high), so that a part left out can still be given its rows."""

    original: str
    parts: tuple[str, ...]
    units: tuple[int, ...] = (1, 1, 1)

    def widths(self, present: Mapping[int, LoraLayer]) -> list[int]:
        slot, layer = next(iter(present.items()))
        unit = int(layer.up.shape[0]) // self.units[slot]
        return [unit * n for n in self.units]


@dataclass(frozen=True)
class Blocks:
    """A kind of block: diffusers' `transformer_blocks.N.` is the original's `double_blocks.N.`, the layers inside
    renamed (`renames`: (diffusers, original)) or fused (`fusions`)."""

    diffusers: str
    original: str
    renames: tuple[tuple[str, str], ...] = ()
    fusions: tuple[Fuse, ...] = ()


def block_layout(
    blocks: tuple[Blocks, ...],
    top: tuple[tuple[str, str], ...] = (),
    prefix: str = DIFFUSION_MODEL,
    entries: Entries = kohya_entries,
    swaps: tuple[str, ...] = (),
    underscores: bool = False,
) -> KohyaLora:
    """A family whose original checkpoint names its blocks and layers otherwise (FLUX.1, SD3, FLUX.2): each adapted
    layer renamed, or fused with its siblings, under `prefix` (kohya's `lora_unet_` takes `underscores` for dots);
    a layer that has no original name is an InputError."""

    def put(out: dict[str, torch.Tensor], name: str, layer: LoraLayer) -> None:
        out.update(entries(prefix + (name.replace(".", "_") if underscores else name), layer))

    def convert(layers: Mapping[str, LoraLayer]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        groups: dict[tuple[str, Fuse], dict[int, LoraLayer]] = {}
        for name, layer in layers.items():
            kind = next((b for b in blocks if name.startswith(b.diffusers)), None)
            if kind is None:
                original = renamed(name, top)
                if original in swaps:  # the output rows' halves the other way round (`_swapped`)
                    layer = LoraLayer(down=layer.down, up=_swapped(layer.up), scale=layer.scale)
                put(out, original, layer)
                continue
            index, _, inner = name[len(kind.diffusers) :].partition(".")
            block = f"{kind.original}{index}."
            fuse = next((f for f in kind.fusions if inner in f.parts), None)
            if fuse is not None:
                groups.setdefault((block, fuse), {})[fuse.parts.index(inner)] = layer
                continue
            inside = dict(kind.renames).get(inner)
            if inside is None:
                raise _no_name(name)
            put(out, block + inside, layer)
        for (block, fuse), present in groups.items():
            parts = [present.get(slot) for slot in range(len(fuse.parts))]
            put(out, block + fuse.original, fused(parts, fuse.widths(present)))
        return out

    return convert


def _no_name(name: str) -> InputError:
    return InputError(f"layer {name}: it has no name in this format; export it as diffusers")


def read_component(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A diffusers or transformers component folder: its config and its weights (every safetensors shard)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(shard))
    return config, state


def _swapped(value: torch.Tensor) -> torch.Tensor:
    """The two halves of an adaptive norm's projection the other way round: the originals put shift before scale,
    diffusers scale before shift (diffusers' `swap_scale_shift`, its own inverse)."""
    first, second = value.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def block_weights(
    blocks: tuple[Blocks, ...],
    top: tuple[tuple[str, str], ...],
    state: Mapping[str, torch.Tensor],
    swaps: tuple[str, ...] = (),
    norms: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """A denoiser's weights under the original checkpoint's names, by the same `Blocks` as its LoRA layout: layers
    renamed, fused parts concatenated by rows; a layer with no rename keeps its name, as diffusers' readers keep
    what they do not rename. `swaps`: original layers whose halves diffusers swaps; `norms`: original RMS norms,
    whose weight the originals call `scale`."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[str, Fuse, str], dict[int, torch.Tensor]] = {}
    for key, value in state.items():
        layer, dot, param = key.rpartition(".")
        if not dot:  # a parameter of the model itself (Z-Image's pad tokens): named alike
            out[key] = value
            continue
        kind = next((b for b in blocks if layer.startswith(b.diffusers)), None)
        if kind is None:
            name = next((new + layer[len(old) :] for old, new in top if layer.startswith(old)), layer)
        else:
            index, _, inner = layer[len(kind.diffusers) :].partition(".")
            block = f"{kind.original}{index}."
            fuse = next((f for f in kind.fusions if inner in f.parts), None)
            if fuse is not None:
                groups.setdefault((block, fuse, param), {})[fuse.parts.index(inner)] = value
                continue
            name = block + dict(kind.renames).get(inner, inner)
        if name in swaps:
            value = _swapped(value)
        if param == "weight" and name.rpartition(".")[2] in norms:
            param = "scale"
        out[f"{name}.{param}"] = value
    for (block, fuse, param), parts in groups.items():
        out[f"{block}{fuse.original}.{param}"] = torch.cat([parts[slot] for slot in range(len(fuse.parts))])
    return out
