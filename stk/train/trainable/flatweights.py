"""The trainable weights as one flat parameter per block, so that DeepSpeed's per-tensor work runs once a block.

ZeRO-1/2 do work per parameter that they own: a gradient hook and a copy into the reduction bucket as each gradient
arrives, a finiteness check (about ten ops) and a norm (two) in the step. Over the 1,120 LoRA tensors of an SDXL UNet
that is most of the ops a step dispatches (bench/overhead.py). Here, as FSDP's flat parameter does, the trainable
weights of each repeated block (`repeated_blocks`: a transformer block) and of each other top-level part
are one flat parameter that DeepSpeed owns; the module's weights become views into it, used by the forward as
before, so their gradients arrive in the flat parameter's, one per block. A block's gradient is whole when that block's
backward ends: ZeRO-2 still reduces while the backward goes on.

The views keep their names and shapes in the module: its state_dict, the EMA, the adapter's export and the
checkpoints' module states read what they read before, and the optimizer's flat partition is the same concatenation
in the same order. DeepSpeed's checkpoints record the parameters it owns, though: a checkpoint written with one
parameter per weight (before this layout, or under ZeRO-3, which partitions each weight itself) is resumed in the
layout it was written in (`layout_for`); each checkpoint records its layout in its stk-run.json.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "FLAT",
    "LAYOUT",
    "PER_WEIGHT",
    "FlatWeights",
    "block_prefixes",
    "flat_groups",
    "layout_for",
    "repeated_blocks",
    "unflattened",
]

FLAT_NAME = "stk_flat_weights_{}"  # as DeepSpeed's checkpoints name them (registered while it is initialised)
LAYOUT = "weights_layout"  # the key of a checkpoint's record (stk-run.json) that names its layout
FLAT, PER_WEIGHT = "flat per block", "per weight"

# one flat parameter's weights, in order, each with the layers that hold it (a weight two layers share: both)
Group = list[tuple[torch.nn.Parameter, list[tuple[torch.nn.Module, str]]]]


def layout_for(zero_stage: int, resumed: dict[str, Any] | None) -> str:
    """The layout of a run under `zero_stage`, resuming a checkpoint of the `resumed` record (None: a new run; a
    checkpoint without a record, or whose record names no layout, holds one parameter per weight)."""
    if zero_stage >= 3:
        return PER_WEIGHT
    return PER_WEIGHT if resumed is not None and resumed.get(LAYOUT) != FLAT else FLAT


def flat_groups(module: torch.nn.Module) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The module's trainable weights (named as `named_parameters` names them), one list per flat parameter: each
    repeated block's, then each other top-level part's, in the module's order. A pure function of the module, so
    stk-export finds in a checkpoint's flat parameters the weights a run put there (`unflattened`)."""
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    blocks = block_prefixes(module)
    for name, param in module.named_parameters():
        if param.requires_grad and param.numel():
            groups.setdefault(_block_of(name, blocks), []).append((name, param))
    return list(groups.values())


def unflattened(state: dict[str, torch.Tensor], module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`state` (a checkpoint's consolidated weights) with each flat parameter cut back into the weights of
    `module` (the denoiser, on the meta device will do) it holds; a state of one entry per weight as it is."""
    if FLAT_NAME.format(0) not in state:
        return state
    state = dict(state)
    for i, group in enumerate(flat_groups(module)):
        flat = state.pop(FLAT_NAME.format(i)).reshape(-1)
        sizes = [param.numel() for _, param in group]
        if flat.numel() != sum(sizes):
            raise ValueError(f"{FLAT_NAME.format(i)}: {flat.numel()} weights, {sum(sizes)} in the model's block")
        pieces = zip(group, flat.split(sizes), strict=True)
        state.update({name: piece.view(param.shape) for (name, param), piece in pieces})
    if left := [key for key in state if key.startswith(FLAT_NAME.format(""))]:
        raise ValueError(f"{', '.join(left)}: more blocks than the model has")
    return state


class FlatWeights:
    """The flat parameters of a module's trainable weights (`flat_groups`)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for owner in module.modules():
            for attr, param in owner._parameters.items():
                if param is not None and param.requires_grad:
                    owners.setdefault(id(param), []).append((owner, attr))
        self.groups: list[Group] = [[(param, owners[id(param)]) for _, param in group] for group in flat_groups(module)]
        self.flats = [self._flatten(group) for group in self.groups]
        self._bound: list[tuple[int, int]] = []  # each flat parameter's version and address when its views were made

    @staticmethod
    def _flatten(group: Group) -> torch.nn.Parameter:
        """One block's weights copied into a flat parameter, each weight then a view of it (its old memory freed)."""
        flat = torch.nn.Parameter(torch.cat([param.detach().reshape(-1) for param, _ in group]))
        for (param, _), view in zip(group, _views(flat.data, group), strict=True):
            param.data = view
        return flat

    @contextmanager
    def registered(self) -> Iterator[list[torch.nn.Parameter]]:
        """The flat parameters registered on the module while DeepSpeed is initialised around it (its engine names
        each parameter it owns then); the module's own parameters as they were after."""
        for i, flat in enumerate(self.flats):
            self.module.register_parameter(FLAT_NAME.format(i), flat)
        try:
            yield self.flats
        finally:
            for i in range(len(self.flats)):
                del self.module._parameters[FLAT_NAME.format(i)]

    def bind(self) -> None:
        """Make each trainable weight of the module a view of its flat parameter for autograd, where DeepSpeed put it:
        a forward through the module then gives the flat parameters their gradients. After DeepSpeed's
        initialisation (which moves each parameter it owns into a buffer of its own), and again before a forward
        wherever a flat parameter was written in place since (a checkpoint loaded into the module's weights, the
        EMA's weights swapped in): autograd refuses a view of a split whose base changed so."""
        self._bound = [self._state(flat) for flat in self.flats]
        for flat, group in zip(self.flats, self.groups, strict=True):
            self._bind(flat, group)
        self.module.register_forward_pre_hook(self._rebind_changed)

    @staticmethod
    def _state(flat: torch.nn.Parameter) -> tuple[int, int]:
        return flat._version, flat.data_ptr()

    @staticmethod
    def _bind(flat: torch.nn.Parameter, group: Group) -> None:
        for (_, places), view in zip(group, _views(flat, group), strict=True):
            for owner, attr in places:
                owner._parameters[attr] = view  # type: ignore[assignment]  # as torch.func.functional_call does

    def _rebind_changed(self, module: torch.nn.Module, args: Any) -> None:
        for i, (flat, group) in enumerate(zip(self.flats, self.groups, strict=True)):
            if self._state(flat) != self._bound[i]:
                self._bind(flat, group)
                self._bound[i] = self._state(flat)


def _views(flat: torch.Tensor, group: Group) -> list[torch.Tensor]:
    pieces = flat.split([param.numel() for param, _ in group])
    return [piece.view(param.shape) for piece, (param, _) in zip(pieces, group, strict=True)]


def repeated_blocks(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The module's repeated blocks, named: those of diffusers' `_repeated_blocks` classes, else (a denoiser that
    names none, SD3's) the items of its own top-level block lists (`transformer_blocks.0`)."""
    kinds = set(getattr(module, "_repeated_blocks", None) or ())
    if kinds:
        return [(name, layer) for name, layer in module.named_modules() if type(layer).__name__ in kinds]
    return [
        (f"{name}.{i}", block)
        for name, layers in module.named_children()
        if isinstance(layers, torch.nn.ModuleList)
        for i, block in enumerate(layers)
    ]


def block_prefixes(module: torch.nn.Module) -> tuple[str, ...]:
    """The names of the module's repeated blocks, with their dot: what each of their weights' names starts with."""
    return tuple(f"{name}." for name, _ in repeated_blocks(module))


def _block_of(name: str, blocks: tuple[str, ...]) -> str:
    """A weight's group: its repeated block, else its top-level part (`down_blocks.1`, `conv_in`)."""
    inside = [block for block in blocks if name.startswith(block)]
    if inside:
        return max(inside, key=len)
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]
