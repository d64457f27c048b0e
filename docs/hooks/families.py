"""MkDocs hook: one page per model family, written from the family's spec and its own prose at build time.

A family is defined once, in stk/models/families/: its `FamilySpec` and the prose beside it. The site reads both
here, so a new family gets its page, its nav entry and its row of the overview table without a line of
documentation being written by hand, and a spec that changes cannot leave the docs behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

FOLDER = "families"
NAV_TITLE = "Model families"
MARKER = "<!-- families: overview -->"


def facts(spec: Any) -> dict[str, str]:
    """What the docs say about one family, as Markdown cells: the one place that reads the spec's fields.

    Kept apart so that when the spec's fields move, this function is the only thing to change.
    """
    from stk.models.alignment import family_alignment

    denoiser, sampling, export = spec.denoiser, spec.sampling, spec.export
    example = denoiser.example
    return {
        "title": spec.title,
        "name": f"`{spec.name.value}`",
        "pipelines": ", ".join(f"`{p}`" for p in spec.pipelines),
        "example": f"`{Path(example.script).name}`",
        "example_script": f"`{example.script}`",
        "timestep_sampling": example.timestep_sampling if denoiser.flow else "DDPM timesteps",
        "latents": "a sample (`params`)" if example.samples_latents else "the mode (`mean`)",
        "lora_targets": ", ".join(f"`{t}`" for t in denoiser.lora_targets),
        "steps": str(sampling.steps),
        "guidance": f"{sampling.guidance:g}",
        "negative_prompt": "the empty caption" if sampling.negative_prompt else "none",
        "published": ", ".join(f"`{name}` ({title})" for name, title in spec.published.items()),
        "objective": "rectified flow" if denoiser.flow else "DDPM",
        "sides": f"{family_alignment(spec.name)} px",
        "kohya": "yes" if export.kohya_lora is not None else "no",
        "single_file": f"yes (`{export.single_file_class}`)" if export.single_file is not None else "no",
    }


def family_specs() -> list[Any]:
    """Every family's spec in the registry's order, imported only when the site is built (torch, diffusers)."""
    from stk.models.families import all_specs

    return all_specs()


def page_path(spec: Any) -> str:
    """The page's path in docs/: families/<name>.md, the name as typed on the command line."""
    return f"{FOLDER}/{spec.name.value}.md"


def prose(spec: Any) -> str:
    """The family's own words: README.md in its folder, stk/models/families/<name>/."""
    from stk.models.families.registry import FOLDER, module_name

    return nested((FOLDER / module_name(spec.name) / "README.md").read_text(encoding="utf-8"))


def nested(markdown: str, levels: int = 2) -> str:
    """`markdown`'s headings moved `levels` down, outside code fences: a README's own "# Title" then sits under
    the page's "## About" instead of competing with the page's title."""
    lines, fenced = [], False
    for line in markdown.splitlines():
        fenced ^= line.lstrip().startswith("```")
        lines.append("#" * levels + line if line.startswith("#") and not fenced else line)
    return "\n".join(lines) + "\n"


TABLE_ROWS = [
    ("Title", "title"),
    ("Name on the command line (`--family`)", "name"),
    ("Detected pipelines (`model_index.json`)", "pipelines"),
    ("Training objective", "objective"),
    ("diffusers training example", "example_script"),
    ("Noise levels (`--timestep-sampling` default)", "timestep_sampling"),
    ("Latents stored (`stk-cache --latents` default)", "latents"),
    ("Default LoRA targets (`--lora-targets`)", "lora_targets"),
    ("Sample steps (`--validation-steps`)", "steps"),
    ("Sample guidance (`--validation-guidance`)", "guidance"),
    ("Negative prompt of samples", "negative_prompt"),
    ("Image sides: multiples of", "sides"),
    ("Published configs (the folder's `configs/`)", "published"),
    ("Export: kohya/ComfyUI LoRA keys", "kohya"),
    ("Export: single file", "single_file"),
]


def family_page(spec: Any) -> str:
    """A family's page: its title, the generated table of what the spec says, then its prose."""
    cells = facts(spec)
    table = "\n".join(f"| {label} | {cells[key]} |" for label, key in TABLE_ROWS)
    return (
        f"# {cells['title']}\n\n"
        "*Generated from the family's spec and its own description in `stk/models/families/`.*\n\n"
        f"| | |\n|---|---|\n{table}\n\n"
        f"## About {cells['title']}\n\n{prose(spec)}\n"
    )


def overview_table(specs: list[Any]) -> str:
    """The overview of every family, one row each, linking each family's page (the families index)."""
    rows = []
    for spec in specs:
        c = facts(spec)
        link = f"[{c['title']}]({Path(page_path(spec)).name})"
        rows.append(
            f"| {c['name']} | {link} | {c['pipelines']} | {c['objective']} ({c['example']}) | {c['lora_targets']} "
            f"| {c['steps']} steps, guidance {c['guidance']} | {c['sides']} |"
        )
    header = "| `--family` | family | pipelines | training | LoRA default targets | samples | sides |\n" + "|---" * 7
    return header + "|\n" + "\n".join(rows)


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Lists every family's page under the nav's "Model families", after its index, so the nav follows the
    registry (mkdocs --strict then checks each page's links like any other)."""
    for entry in config.nav or []:
        if isinstance(entry, dict) and NAV_TITLE in entry:
            section = entry[NAV_TITLE]
            section.extend({facts(s)["title"]: page_path(s)} for s in family_specs())
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Adds the generated families/<name>.md pages to the site's files."""
    for spec in family_specs():
        files.append(File.generated(config, page_path(spec), content=family_page(spec)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Puts the generated overview table where the families index has its marker."""
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, overview_table(family_specs()))
    return markdown
