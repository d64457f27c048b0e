"""The stk package's import graph has no cycle: each module's imports, at the top, under TYPE_CHECKING or inside
a function, read from the source (nothing is imported)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

import stk

ROOT = Path(stk.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _imports(name: str, path: Path, is_package: bool, modules: set[str]) -> set[str]:
    """The stk modules `name` imports: `from a.b import c` is a.b.c when that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                package = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{package}.{base}".rstrip(".")
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return (found & modules) - {name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, is_package, set(modules)) for name, (path, is_package) in modules.items()}


def test_the_import_graph_is_read_and_has_no_cycle() -> None:
    graph = import_graph()
    assert "stk.shards.config" in graph["stk.shards.manifest"]  # the reading finds imports at all
    assert "stk.models.latents" in graph["stk.shards.config"]
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


def test_stk_train_imports_nothing_from_stk_cache() -> None:
    """stk-train depends on the cache's format (stk/shards), not on the stk-cache command."""
    assert not _crossings(import_graph(), "stk.train", "stk.cache")


def _crossings(graph: dict[str, set[str]], importer: str, imported: str) -> list[str]:
    """Every import from a module under `importer` of one under `imported`."""
    return sorted(
        f"{m} -> {i}"
        for m, imports in graph.items()
        if m.startswith(importer)
        for i in imports
        if i.startswith(imported)
    )


@pytest.mark.parametrize(
    ("lower", "upper"),
    [
        ("stk.models", "stk.train"),  # a family reads the trainer's types from stk.models.interface
        ("stk.models", "stk.cache"),
        ("stk.models", "stk.cli"),
        ("stk.shards", "stk.train"),  # the cache's format knows neither command
        ("stk.shards", "stk.cache"),
        ("stk.train", "stk.cli"),
        ("stk.cache", "stk.cli"),
        ("stk.cache", "stk.train"),
    ],
)
def test_the_layers_import_downwards_only(lower: str, upper: str) -> None:
    """The packages are layers: the CLI over the commands' libraries (stk.train, stk.cache) over the models and the
    cache's format; no module of a lower layer imports one of a higher, even only for its types."""
    assert not _crossings(import_graph(), lower, upper)


LIFECYCLE = ("stk.train.run", "stk.train.setup", "stk.train.loop", "stk.train.step", "stk.train.finish")
JOBS = ("checkpoint", "data", "validation", "trainable", "deepspeed", "objective", "report")


@pytest.mark.parametrize("job", JOBS)
def test_the_trainers_jobs_never_import_its_lifecycle(job: str) -> None:
    """stk/train/ keeps a run's lifecycle at its top (run, setup, loop, step, finish) over packages grouped by job;
    a job's modules serve the lifecycle and never import it."""
    graph = import_graph()
    assert any(m.startswith(f"stk.train.{job}.") for m in graph), job
    assert not [crossing for phase in LIFECYCLE for crossing in _crossings(graph, f"stk.train.{job}", phase)]


@pytest.mark.parametrize("base", ["stk.images", "stk.cluster"])
def test_the_image_and_cluster_modules_import_no_command_library(base: str) -> None:
    graph = import_graph()
    for upper in ("stk.models", "stk.scan", "stk.shards", "stk.cache", "stk.train", "stk.export", "stk.cli"):
        assert not _crossings(graph, base, upper)
