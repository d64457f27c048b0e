"""Every family's defaults are its diffusers training example's (FamilySpec.denoiser.example): the scripts' own argument
parsers, scheduler and noise-level lines (tests/reference/diffusers_examples/, run by support.diffusers_examples)
against stk-train's and stk-cache's settings with no option given. A default that moves in a later release of the
scripts fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.diffusers_examples import example_args, example_latents, example_sigmas

from stk.cli.common import default_of
from stk.models import Family, build_tiny_model
from stk.models.families import all_specs, spec_for
from stk.shards.config import EncodeSettings
from stk.train.objective.losses import LossSettings
from stk.train.objective.objectives import FlowObjective, objective_for
from stk.train.options import TrainOptions

FLOW = [spec.name for spec in all_specs() if spec.denoiser.flow]
DDPM = [spec.name for spec in all_specs() if not spec.denoiser.flow]
WEIGHTING = {"none": "uniform", "logit_normal": "logit-normal"}  # the scripts' --weighting_scheme as stk names it
DRAWS = 10_000


def ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical distributions."""
    a, b = a.double().sort().values, b.double().sort().values
    points = torch.cat([a, b])
    gap = torch.searchsorted(a, points, right=True) / len(a) - torch.searchsorted(b, points, right=True) / len(b)
    return float(gap.abs().max())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[Family, str]:
    root = tmp_path_factory.mktemp("example-models")
    return {family: build_tiny_model(family, str(root / family.value)) for family in FLOW}


@pytest.mark.parametrize("family", FLOW, ids=str)
def test_flow_defaults_are_the_examples(family: Family) -> None:
    script = spec_for(family).denoiser.example.script
    args = example_args(script)
    settings = LossSettings()
    assert settings.sampling(family) == WEIGHTING[args.weighting_scheme]
    assert (settings.logit_mean, settings.logit_std) == (args.logit_mean, args.logit_std)
    assert settings.flow_shift == "example"  # the scripts have no shift option: their scheduler's table
    assert spec_for(family).denoiser.precondition_outputs == bool(getattr(args, "precondition_outputs", False))
    if hasattr(args, "guidance_scale"):
        assert default_of(TrainOptions, "guidance_scale") == args.guidance_scale


@pytest.mark.parametrize("family", DDPM, ids=str)
def test_ddpm_defaults_are_the_examples(family: Family) -> None:
    args = example_args(spec_for(family).denoiser.example.script)
    settings = LossSettings()
    assert (settings.snr_gamma, settings.noise_offset) == (args.snr_gamma, args.noise_offset)
    assert settings.caption_dropout == (getattr(args, "proportion_empty_prompts", None) or 0.0)
    assert getattr(args, "timestep_bias_strategy", "none") == "none"  # uniform timesteps, as stk draws them


@pytest.mark.parametrize("family", list(Family), ids=str)
def test_latents_are_sampled_or_the_mode_as_the_example_takes_them(family: Family) -> None:
    samples = example_latents(spec_for(family).denoiser.example.script) == "sample"
    assert spec_for(family).denoiser.example.samples_latents is samples
    assert EncodeSettings().for_family(family).store_logvar is samples  # stk-cache keeps what sampling needs
    assert EncodeSettings(store_logvar=not samples).for_family(family).store_logvar is (not samples)  # as given


def stk_sigmas(family: Family, model: str, settings: LossSettings, seed: int) -> torch.Tensor:
    objective = objective_for(family, model, settings=settings)
    assert isinstance(objective, FlowObjective)
    return objective.sigmas(DRAWS, 4096, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FLOW, ids=str)
def test_noise_levels_are_distributed_as_the_examples_draw_them(family: Family, models: dict[Family, str]) -> None:
    script = spec_for(family).denoiser.example.script
    theirs = example_sigmas(script, example_args(script), models[family], DRAWS, seed=1)
    ours = stk_sigmas(family, models[family], LossSettings(), seed=2)
    assert ks_statistic(ours, theirs) < 0.02
    assert ks_statistic(ours, example_sigmas(script, example_args(script), models[family], DRAWS, seed=3)) < 0.02
    # the test can fail: another shift (toward less noise than any family's) is another distribution
    assert ks_statistic(stk_sigmas(family, models[family], LossSettings(flow_shift=0.5), seed=2), theirs) > 0.1


@pytest.mark.parametrize(("family", "mean"), [(Family.SD3, 1.0), (Family.SD3, -1.0), (Family.FLUX, 1.0)], ids=str)
def test_a_logit_mean_is_the_examples(family: Family, mean: float, models: dict[Family, str]) -> None:
    """--logit-mean M is the scripts' --logit_mean M: they index a descending table, so M > 0 means less noise."""
    script = spec_for(family).denoiser.example.script
    args = example_args(script, "--weighting_scheme", "logit_normal", "--logit_mean", str(mean))
    theirs = example_sigmas(script, args, models[family], DRAWS, seed=1)
    ours = stk_sigmas(family, models[family], LossSettings(timestep_sampling="logit-normal", logit_mean=mean), seed=2)
    assert ks_statistic(ours, theirs) < 0.02
    assert (float(ours.median()) < 0.6) is (mean > 0)


def test_the_reference_scripts_are_the_ones_the_specs_name() -> None:
    here = {p.name for p in (Path(__file__).parents[3] / "reference" / "diffusers_examples").glob("*.py")}
    assert {Path(spec.denoiser.example.script).name for spec in all_specs()} == here


def documented_defaults() -> dict[str, list[str]]:
    """The docs' "Training defaults" table (docs/families/index.md): family -> its cells (example, noise levels,
    latents)."""
    page = (Path(__file__).parents[4] / "docs" / "families" / "index.md").read_text()
    section = page.split("## Training defaults", 1)[1].split("\n\n- ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| `") and not line.startswith("| `--") and len(cells) == 4:
            rows.update({name.strip(" `"): cells[1:] for name in cells[0].split(",")})
    return rows


def test_the_docs_defaults_table_says_what_stk_does(models: dict[Family, str]) -> None:
    rows = documented_defaults()
    assert set(rows) == {family.value for family in Family}
    for family in Family:
        example, levels, latents = rows[family.value]
        spec = spec_for(family)
        assert Path(spec.denoiser.example.script).name.removeprefix("train_dreambooth_lora") in example.replace(
            "...", ""
        )
        assert latents.startswith("a sample" if EncodeSettings().for_family(family).store_logvar else "the mode")
        if spec.denoiser.flow:
            assert levels.startswith(LossSettings().sampling(family))
            assert ("unshifted" in levels) is (
                flow_objective(family, models[family]).scheduler.config.use_dynamic_shifting
            )
    sd3 = stk_sigmas(Family.SD3, models[Family.SD3], LossSettings(timestep_sampling="logit-normal", logit_mean=1.0), 2)
    assert float(sd3.median()) == pytest.approx(0.53, abs=0.01)  # "SD3.5's median sigma 0.53"


def flow_objective(family: Family, model: str) -> FlowObjective:
    objective = objective_for(family, model)
    assert isinstance(objective, FlowObjective)
    return objective
