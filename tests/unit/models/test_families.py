"""stk.models.families: every family's spec is complete and its own, detection finds each family from its pipeline
names, listing the names stays cheap, and no module outside stk/models/families/ names a family."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import ModelMixin
from support.commands import REPO

from stk.errors import InputError
from stk.models import Encoders
from stk.models.families import DEMO_FAMILY, Family, all_specs, detect_family, family_names, spec_for
from stk.models.families import spec as spec_module
from stk.models.families.registry import module_name
from stk.models.families.spec import FamilySpec
from stk.models.published import published_config

STK = REPO / "stk"
HOME = STK / "models" / "families"
specs = pytest.mark.parametrize("spec", all_specs(), ids=lambda spec: spec.name.value)


@specs
def test_each_spec_is_complete_and_its_own(spec: FamilySpec) -> None:
    assert spec is spec_for(spec.name) and spec is spec_for(spec.name.value)
    assert spec.title and spec.pipeline_class.__name__ in spec.pipelines
    assert issubclass(spec.text.encoders, Encoders) and spec.text.encoders.family is spec.name
    assert not inspect.isabstract(spec.text.encoders)
    assert issubclass(spec.denoiser.model_class, ModelMixin)
    assert spec.denoiser.subfolder in inspect.signature(spec.pipeline_class).parameters
    assert spec.denoiser.lora_targets and all(spec.denoiser.lora_targets)
    assert spec.sampling.steps > 0 and spec.sampling.guidance > 0
    assert spec.latents.patch_size >= 1 and spec.latents.alignment(8) == 8 * spec.latents.patch_size
    latents = torch.randn(2, 4, 4, 6)
    packed = spec.latents.pack(latents)
    assert packed.numel() == latents.numel() and packed.shape[0] == 2
    assert spec.published
    for name in spec.published:
        for component, cls in (("denoiser", spec.denoiser.model_class), ("vae", None)):
            config = published_config(name, component)  # the package's file, as installed
            assert cls is None or config["_class_name"] == cls.__name__


def test_the_registry_is_one_name_per_family_and_one_family_per_pipeline() -> None:
    assert family_names() == [spec.name.value for spec in all_specs()] == [f.value for f in Family]
    assert all((HOME / module_name(family) / "__init__.py").is_file() for family in Family)
    pipelines = [name for spec in all_specs() for name in spec.pipelines]
    assert len(pipelines) == len(set(pipelines))
    published = [name for spec in all_specs() for name in spec.published]
    assert len(published) == len(set(published))
    assert DEMO_FAMILY in Family
    with pytest.raises(ValueError):
        spec_for("sd4")


@pytest.mark.parametrize("pipeline", [name for spec in all_specs() for name in spec.pipelines])
def test_each_pipeline_name_is_detected_as_its_family(pipeline: str, tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    (expected,) = [spec.name for spec in all_specs() if pipeline in spec.pipelines]
    assert detect_family(str(tmp_path)) is expected


def test_an_unknown_pipeline_lists_every_known_one(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    with pytest.raises(InputError, match="WanPipeline") as raised:
        detect_family(str(tmp_path))
    assert all(name in str(raised.value) for spec in all_specs() for name in spec.pipelines)
    assert "pass --family " + "|".join(family_names()) in str(raised.value)


def test_listing_the_names_imports_no_model_library() -> None:
    code = (
        "import sys; from stk.models.families import family_names; assert family_names(); "
        "assert not {'torch', 'diffusers', 'transformers'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _namings(source: str) -> list[tuple[int, str]]:
    """Where `source` names a family: a Family member, a string or identifier word that is a family's name, one of
    its pipelines or published configs, or an import of a family's module. Docstrings are prose and not read."""
    names = {spec.name.value for spec in all_specs()}
    strings = names | {n.lower() for spec in all_specs() for n in (*spec.pipelines, *spec.published)}
    members = {family.name for family in Family}
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Family":
            if node.attr in members:
                found.append((line, f"Family.{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value.lower() in strings:
                found.append((line, repr(node.value)))
        elif isinstance(node, ast.Name | ast.FunctionDef | ast.ClassDef | ast.arg):
            identifier = getattr(node, "id", None) or getattr(node, "name", None) or getattr(node, "arg", "")
            if names & set(identifier.lower().split("_")):
                found.append((line, identifier))
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported = {node.module.split(".")[-1], *(alias.name for alias in node.names)}
            if node.module.startswith("stk.models.families") and names & imported:
                found.append((line, f"import of {node.module}"))
    return found


def test_the_check_finds_a_family_named_in_each_way() -> None:
    source = (
        '"""flux in prose is fine."""\n'
        "from stk.models.families.flux import SPEC\n"
        "from stk.models.families import sdxl\n"
        "def f(family, is_flux):\n"
        "    return family is Family.SD or family == 'sdxl' or name == 'FluxPipeline' or config == 'flux-dev'\n"
    )
    found = {what for _, what in _namings(source)}
    assert found == {
        "import of stk.models.families.flux",
        "import of stk.models.families",
        "is_flux",
        "Family.SD",
        "'sdxl'",
        "'FluxPipeline'",
        "'flux-dev'",
    }
    assert _namings('"""Flux, SDXL"""\nx = spec.denoiser.flow and Family(name)\n') == []


def test_no_module_outside_the_families_home_names_a_family() -> None:
    outside = [path for path in sorted(STK.rglob("*.py")) if HOME not in path.parents]
    assert len(outside) > 50
    named = {
        f"{path.relative_to(STK)}:{line}: {what}": None
        for path in outside
        for line, what in _namings(path.read_text(encoding="utf-8"))
    }
    assert not named, "\n".join(named)


def test_a_copied_folder_is_a_new_family_with_nothing_else_changed(tmp_path: Path) -> None:
    """What adding a family takes: a copy of SDXL's folder under a new name (its published config renamed, a name
    being one family's) is registered, offered on the command line, and builds and loads its tiny pipeline."""
    shutil.copytree(STK, tmp_path / "stk", ignore=shutil.ignore_patterns("__pycache__"))
    folder = tmp_path / "stk" / "models" / "families" / "sdxl_copy"
    shutil.copytree(HOME / "sdxl", folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "configs" / "sdxl").rename(folder / "configs" / "sdxl-copy")
    init = folder / "__init__.py"
    init.write_text(init.read_text().replace('published={"sdxl":', 'published={"sdxl-copy":'))
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from stk.cli.scan import main\n"
        "from stk.models import build_tiny_model, load_encoders\n"
        "from stk.models.families import family_names, spec_for\n"
        "from stk.models.published import published_config\n"
        "assert 'sdxl-copy' in family_names(), family_names()\n"
        "assert 'sdxl-copy' in CliRunner().invoke(main, ['--help']).output\n"
        "spec = spec_for('sdxl-copy')\n"
        "assert spec.title == 'SDXL' and spec.name.value == 'sdxl-copy'\n"
        "assert published_config('sdxl-copy', 'vae')['_class_name'] == 'AutoencoderKL'\n"
        "model = build_tiny_model(spec.name, sys.argv[1])\n"
        "assert load_encoders(model, spec.name, device='cpu').config()['family'] == 'sdxl-copy'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "model")], check=True, env=env, cwd=tmp_path)


def test_the_template_is_not_a_family_and_names_every_part_of_a_spec() -> None:
    """The unregistered `_template/` folder a newcomer copies: never listed, and its SPEC passes every field of
    FamilySpec and every field of a part that has no default, so the template cannot fall behind the spec."""
    assert "_template" not in family_names() and "-template" not in family_names()
    tree = ast.parse((HOME / "_template" / "__init__.py").read_text())
    calls = {
        node.func.id: {keyword.arg for keyword in node.keywords}
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith("Spec")
    }
    for part, given in calls.items():
        fields = dataclasses.fields(getattr(spec_module, part))
        needed = {
            f.name for f in fields if part == "FamilySpec" or f.default is f.default_factory is dataclasses.MISSING
        }
        assert needed <= given, f"{part}: the template leaves out {sorted(needed - given)}"
    assert set(calls) == {
        "FamilySpec",
        "TextSpec",
        "LatentSpec",
        "DenoiserSpec",
        "SamplingSpec",
        "TinySpec",
        "ExportSpec",
    }
    assert {(HOME / "_template" / name).is_file() for name in ("tiny.py", "README.md")} == {True}


def test_the_readmes_family_table_lists_every_family_and_no_other() -> None:
    """The front page's short table is written by hand: it names each registered family once."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Model families", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| `")]
    listed = [row.strip("`") for row in rows if row != "`--family`"]
    assert sorted(listed) == sorted(family_names())
