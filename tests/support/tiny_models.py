"""Each family's tiny pipeline, built once per test session and shared: tests that change a model copy it first."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from stk.models import Encoders, Family, build_tiny_model, load_encoders


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Family], str]:
    """tiny_model(family) -> the directory of its tiny random-weight pipeline (seed 0), built on first use."""
    built: dict[Family, str] = {}

    def get(family: Family) -> str:
        if family not in built:
            built[family] = build_tiny_model(family, str(tmp_path_factory.mktemp(f"tiny-{family.value}")))
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_encoders(tiny_model: Callable[[Family], str]) -> Callable[[Family], Encoders]:
    """tiny_encoders(family) -> its tiny pipeline's encoders on the CPU, loaded once a session."""
    loaded: dict[Family, Encoders] = {}

    def get(family: Family) -> Encoders:
        if family not in loaded:
            loaded[family] = load_encoders(tiny_model(family), device="cpu")
        return loaded[family]

    return get
