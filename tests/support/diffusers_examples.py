"""diffusers' training examples (tests/reference/diffusers_examples/), run line by line: their argument parser for
the defaults, and the lines that build their scheduler and draw a batch's noise levels. Nothing is transcribed: the
statements are cut from the scripts' syntax trees and executed as they are."""

from __future__ import annotations

import argparse
import ast
import copy
import enum
import inspect
import os
import re
import sys
import warnings
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling

EXAMPLES = Path(__file__).resolve().parents[1] / "reference" / "diffusers_examples"
# what each kind of script requires on its command line before it parses
REQUIRED = {
    "train_text_to_image": ["--pretrained_model_name_or_path", "model", "--train_data_dir", "images"],
    "train_dreambooth": [
        "--pretrained_model_name_or_path",
        "model",
        "--instance_data_dir",
        "images",
        "--instance_prompt",
        "a photo",
    ],
}


class InterpolationMode(enum.Enum):
    """torchvision's names, which the text-to-image scripts list as --image_interpolation_mode's choices."""

    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


@cache
def _tree(script: str) -> ast.Module:
    return ast.parse((EXAMPLES / Path(script).name).read_text())


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def example_args(script: str, *extra: str) -> argparse.Namespace:
    """The script's parse_args on its required arguments and `extra`: its defaults, as a user running it gets them."""
    transforms = SimpleNamespace(InterpolationMode=InterpolationMode)
    namespace: dict[str, Any] = {"argparse": argparse, "os": os, "warnings": warnings, "transforms": transforms}
    exec(compile(ast.Module([_function(_tree(script), "parse_args")], []), script, "exec"), namespace)
    required = next(args for prefix, args in REQUIRED.items() if Path(script).name.startswith(prefix))
    parse_args = namespace["parse_args"]
    if inspect.signature(parse_args).parameters:  # parse_args(input_args)
        args: argparse.Namespace = parse_args([*required, *extra])
        return args
    with mock.patch.object(sys, "argv", [script, *required, *extra]):  # parse_args() of the command line
        args = parse_args()
    return args


def example_latents(script: str) -> str:
    """How the script's training loop takes the VAE's latents: "sample" (latent_dist.sample()) or "mode"."""
    calls = set(re.findall(r"(?:latent_dist|latents_cache\[step\])\.(sample|mode)\(\)", _source(script)))
    assert len(calls) == 1, f"{script}: latents taken as {calls}"
    return calls.pop()


def _source(script: str) -> str:
    return (EXAMPLES / Path(script).name).read_text()


def _statements(tree: ast.AST, first: str, last: str) -> list[ast.stmt]:
    """The statements of one block, from the assignment to `first` to the one to `last`."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        targets = [_assigned(stmt) for stmt in body]
        if first in targets and last in targets[targets.index(first) :]:
            start = targets.index(first)
            return body[start : targets.index(last, start) + 1]
    raise AssertionError(f"no block assigns {first} then {last}")


def _assigned(stmt: ast.stmt) -> str | None:
    if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    return None


def example_sigmas(script: str, args: argparse.Namespace, model: str, count: int, seed: int) -> torch.Tensor:
    """(count,) noise levels as the script draws them for a batch of `count`, with its scheduler made from
    `model`'s scheduler/ (its own from_pretrained line, with whatever it passes) and torch's global seed `seed`."""
    tree = _tree(script)
    main = _function(tree, "main")
    args = copy.copy(args)
    args.pretrained_model_name_or_path, args.revision = model, None
    namespace: dict[str, Any] = {
        "FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscreteScheduler,
        "copy": copy,
        "torch": torch,
        "args": args,
        "compute_density_for_timestep_sampling": compute_density_for_timestep_sampling,
        "accelerator": SimpleNamespace(device=torch.device("cpu")),
        "bsz": count,
        "model_input": torch.zeros(count, 1, 1, 1),
    }
    lines = [
        *_statements(main, "noise_scheduler", "noise_scheduler_copy"),
        _function(main, "get_sigmas"),
        *_statements(main, "u", "sigmas"),
    ]
    torch.manual_seed(seed)
    exec(compile(ast.Module(lines, []), script, "exec"), namespace)
    sigmas: torch.Tensor = namespace["sigmas"]
    return sigmas.flatten().float()
