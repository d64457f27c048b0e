"""A dataset list file that stk refuses: the one line it gets."""

from __future__ import annotations

import pytest

from stk.datasets import read_datasets
from stk.errors import ExitCode, InputError


def refusal(path: str) -> str:
    """The InputError (exit 3) that reading the list in `path` raises, checked to be one line naming the file."""
    with pytest.raises(InputError) as caught:
        read_datasets(path)
    message = str(caught.value)
    assert caught.value.exit_code is ExitCode.INPUT
    assert message.startswith((f"{path}: ", f"{path}, ")) and "\n" not in message
    return message
