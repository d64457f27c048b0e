"""Validation prompts, shared by stk-cache (which embeds them into a cache) and stk-train (which makes sample images
of them), and the empty caption every cache stores (stk-train's --caption-dropout, and the negative of
classifier-free guidance in samples)."""

from __future__ import annotations

import re

from stk.errors import InputError
from stk.storage.failures import storage_errors

__all__ = ["EMPTY_CAPTION", "prompt_slug", "read_prompts"]

EMPTY_CAPTION = ""
_SLUG_CHARS = 40


def read_prompts(path: str) -> list[str]:
    """One prompt per line; blank lines and the whitespace around each prompt are dropped. A file with no prompt
    is refused: a run asked for samples and would silently make none."""
    with storage_errors(path):
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            raise InputError(f"{path}: no such prompt file") from None
        except UnicodeDecodeError as exc:
            raise InputError(f"{path}: not a UTF-8 text file of prompts ({exc.reason} at byte {exc.start})") from None
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise InputError(f"{path}: no prompts in it (one per line)")
    return prompts


def prompt_slug(prompt: str) -> str:
    """A file-name-safe short form of a prompt: lower case, runs of anything else than a-z and 0-9 as one '-'."""
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:_SLUG_CHARS].rstrip("-")
    return slug or "prompt"
