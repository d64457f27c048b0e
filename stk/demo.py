"""`make demo`: the main job on a built-in default, so a new user sees stk work in a minute.

Generates a small mixed dataset (every format, rotated photos, captions, one broken file) and
scans it with 2 MPI ranks, exactly as a cluster job would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import click

from stk.datagen import generate_dataset


def _mpiexec() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else shutil.which("mpiexec") or "mpiexec"


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--dir", "workdir", default="demo-output", help="Where the dataset and the scan go (replaced).")
@click.option("--images", default=96, help="Images to generate.")
@click.option("--ranks", default=2, help="MPI ranks for the scan.")
def main(workdir: str, images: int, ranks: int) -> None:
    """Generate a small dataset and scan it with MPI ranks."""
    shutil.rmtree(workdir, ignore_errors=True)
    data, scan = os.path.join(workdir, "images"), os.path.join(workdir, "scan")
    generate_dataset(data, images)
    with open(os.path.join(data, "broken.jpg"), "wb") as f:
        f.write(b"not really a jpeg")
    click.echo(f"generated {images} images (+1 broken file) in {data}", err=True)
    command = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "stk.cli.scan", data, "--out", scan]
    command += ["--resolution", "64", "--alignment", "16", "--batch-size", "2", "--max-errors", "5"]
    command += ["--allow-oversubscription"]  # small demo buckets: apply the repeats they need
    click.echo("$ " + " ".join(command), err=True)
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise SystemExit(result.returncode)
    summary = json.loads(result.stdout)
    click.echo(
        f"\nscanned {summary['files']} files on {summary['ranks']} ranks: {summary['images']} images in "
        f"{summary['buckets']} buckets, {summary['errors']} error(s).\n"
        f"  table:   {scan}/metadata.parquet\n  buckets: {scan}/buckets.json\n  errors:  {scan}/errors.jsonl",
        err=True,
    )


if __name__ == "__main__":
    main()
