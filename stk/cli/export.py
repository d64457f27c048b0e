"""stk-export: click wiring; the work is in stk.export."""

from __future__ import annotations

import click

from stk.cli.common import CONTEXT, default_of, run_command, run_process, verbosity_options
from stk.cluster.world import World
from stk.export import FORMATS, ExportOptions, Format, export
from stk.export.adapters import kohya_families
from stk.export.single import single_file_families
from stk.models.families import Family, family_names

EPILOG = f"""\b
Examples:
  stk-export run1/final lora.safetensors --format kohya
  stk-export run1/checkpoints/step-00001000 lora-1000.safetensors --format kohya
  stk-export run1/final model.safetensors --format single-file
  stk-export run1/checkpoints/step-00001000 model-1000.safetensors --format single-file --model ./sdxl

\b
SOURCE is stk-train's OUTPUT/final, or one of its checkpoints (a full fine-tune's holds the
denoiser alone, as DeepSpeed's shards: --model names the pipeline for the rest). Formats:
  diffusers    the diffusers/peft LoRA file (`pipe.load_lora_weights`), as stk-train writes it
  kohya        a LoRA under kohya/ComfyUI's keys (lora_unet_..., or diffusion_model.... with the model's own
               layer names); families: {", ".join(kohya_families())}
  single-file  a full fine-tune as one .safetensors in the original layout, read back by
               from_single_file; families: {", ".join(single_file_families())}
               (a UNet family's: the LDM checkpoint, UNet, VAE and text encoders; a transformer's: itself)
Adapters and formats: {"; ".join(f"{kind}: {', '.join(f.value for f in fits)}" for kind, fits in FORMATS.items())}.

\b
Exit codes (nothing is written but on 0): 0 written; 2 bad option; 3 SOURCE is not a final/ or
checkpoint, the format cannot hold what it holds, a full fine-tune's checkpoint without --model or
with one of another family, a --family that SOURCE's record or weights contradict, an adapter
holding NaN, or OUT exists (nothing is overwritten); 6 SOURCE is damaged (a checkpoint's file not
matching its sha256 in stk-run.json, a weights file that is not whole safetensors); 69 the disk
failed (full, read-only, or the file over the file-size limit).
"""


@click.command("export", context_settings=CONTEXT("export"), epilog=EPILOG)
@click.argument("source", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option(
    "--format",
    "format_",
    envvar="STK_EXPORT_FORMAT",
    type=click.Choice([f.value for f in Format]),
    default=default_of(ExportOptions, "format").value,
    show_envvar=True,
    help="The output format (see below).",
)
@click.option(
    "--family",
    type=click.Choice(family_names()),
    default=None,
    show_envvar=True,
    help="The model family, where SOURCE does not record it (an adapter's final/ without its run's "
    "checkpoints) [default: from the run].",
)
@click.option(
    "--model",
    default=None,
    show_envvar=True,
    help="A full fine-tune's checkpoint: the pipeline the run trained (its --model), for the components "
    "the checkpoint does not hold.",
)
@verbosity_options
def main(source: str, out: str, format_: str, family: str | None, model: str | None, verbose: int, quiet: bool) -> None:
    """Write what stk-train trained (SOURCE) as OUT, in a format other tools load."""
    opts = ExportOptions(source, out, Format(format_), Family(family) if family else None, model)

    def body(world: World) -> int:
        export(opts)
        return 0

    run_command("stk-export", verbose, quiet, None, body, per_node=True)


def entry() -> None:
    """The `stk-export` executable."""
    run_process(main, "stk-export")


if __name__ == "__main__":
    entry()
