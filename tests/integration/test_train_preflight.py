"""stk-train's preflight and bad setups: a clear message and a documented code, before any model loads.

Real DeepSpeed engines on the CPU under `mpiexec -n 2`, tiny random-weight pipelines and caches made by stk-cache
(fixtures `scan` and `setups`)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.commands import FAST, MPIEXEC, TRAIN, clean_env, scan_env, train_env

from stk.cli.train import main as train_main
from stk.errors import ExitCode
from stk.models import Family
from stk.models.families import family_hint

pytestmark = pytest.mark.integration


def test_nodes_with_different_gpu_counts_are_refused(tmp_path):
    code = (
        "from stk.cluster.world import get_world\n"
        "from stk.train.preflight import check_gpu_layout\n"
        "from stk.errors import PreflightFailed\n"
        "world = get_world()\n"
        "world.node = f'node{world.rank}'\n"
        "try:\n    check_gpu_layout(world, 8 if world.rank == 0 else 4)\n"
        "except PreflightFailed as exc:\n    print(exc)\n"
    )
    proc = subprocess.run(
        [str(MPIEXEC), "-n", "2", TRAIN[0], "-c", code], capture_output=True, text=True, env=train_env(), timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("nodes have different numbers of GPUs (node0: 8, node1: 4)") == 2


@pytest.fixture(scope="module")
def wider_scan(scan: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The training images (copied with their mtimes, so their cache keys hold) plus two new ones, scanned."""
    from stk.datagen import make_image

    summary = json.loads((scan / "summary.json").read_text())
    data = tmp_path_factory.mktemp("wider") / "data"
    shutil.copytree(summary["root"], data)
    for i in range(2):
        make_image(72, 72, seed=500 + i).save(data / f"extra_{i}.png")
    out = tmp_path_factory.mktemp("wider-scan") / "scan"
    command = [
        TRAIN[0],
        "-m",
        "stk.cli.scan",
        data,
        "--out",
        out,
        "--resolution",
        "64",
        "--alignment",
        "64",
        "-q",
        "--allow-oversubscription",
    ]
    proc = subprocess.run(list(map(str, command)), capture_output=True, text=True, env=scan_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


BAD_SETUPS = {
    "bucket-too-small": (
        ["--batch-size", "32"],
        ExitCode.BATCH_CHECK,
        ["hold fewer samples than the effective batch size 32", "needs --repeats >= 2"],
    ),
    "no-cache": (["--no-cache"], ExitCode.INPUT, ["give --cache"]),
    "on-the-fly-without-scan": (["--no-cache", "--no-scan", "--vae-on-the-fly"], ExitCode.INPUT, ["give --scan"]),
    "family-mismatch": (["--other-model"], ExitCode.INPUT, ["was made for a sd model", "is sdxl"]),
    "family-unknown": (
        ["--unknown-model"],
        ExitCode.INPUT,
        [
            "pipeline 'WanPipeline' is not one stk knows",
            "StableDiffusion3Pipeline",
            family_hint(),
        ],
    ),
    "deepspeed-not-json": (["--deepspeed", "BAD_JSON"], ExitCode.INPUT, ["not valid JSON"]),
    "deepspeed-missing": (["--deepspeed", "/nonexistent/ds.json"], ExitCode.INPUT, ["No such file", "zero2-offload"]),
    "deepspeed-fp16": (["--deepspeed", "FP16"], ExitCode.INPUT, ["fp16 is not supported"]),
    "resume-missing": (["--resume", "/nonexistent/step-00000001"], ExitCode.INPUT, ["no such checkpoint directory"]),
    "cache-does-not-cover-scan": (
        ["--wider-scan"],
        ExitCode.INCOMPLETE,
        ["2 scan rows have no cached latent", "extra_0.png", "extra_1.png"],
    ),
    "cache-missing": (["--cache", "/nonexistent/cache"], ExitCode.INPUT, ["no manifest.json"]),
    "lora-targets-unknown": (
        ["--lora-rank", "4", "--lora-targets", "to_q,attn3"],
        ExitCode.INPUT,
        ["--lora-targets attn3: no such layer in the sd denoiser", "to_out.0, to_q, to_v"],
    ),
    "dora-with-loha": (
        ["--lora-rank", "4", "--adapter", "loha", "--dora"],
        ExitCode.INPUT,
        ["--dora with --adapter loha: DoRA is a kind of LoRA"],
    ),
    "adapter-without-rank": (["--adapter", "lokr"], ExitCode.INPUT, ["--adapter lokr: give --lora-rank"]),
    "base-precision-without-adapter": (
        ["--base-precision", "int8"],
        ExitCode.INPUT,
        ["--base-precision int8 quantises the frozen base of an adapter"],
    ),
    "base-precision-under-zero3": (
        ["--lora-rank", "4", "--deepspeed", "zero3", "--base-precision", "int8"],
        ExitCode.INPUT,
        ["ZeRO-3 cannot partition torchao's quantised weights"],
    ),
    "fp8-without-gpu": (
        ["--lora-rank", "4", "--base-precision", "fp8"],
        ExitCode.INPUT,
        ["--base-precision fp8 needs a GPU of compute capability 8.9", "has none (cpu)"],
    ),
    "fp8-matmuls-on-a-quantised-base": (
        ["--lora-rank", "4", "--base-precision", "int8", "--fp8-matmuls"],
        ExitCode.INPUT,
        ["--fp8-matmuls multiplies", "--base-precision int8 holds"],
    ),
    "prompt-file-empty": (["--validation-prompts", "EMPTY"], ExitCode.INPUT, ["no prompts in it (one per line)"]),
    "sample-size-unaligned": (
        ["--validation-prompt", "a", "--validation-resolution", "100x64"],
        ExitCode.INPUT,
        ["--validation-resolution 100x64: SD needs sides that are multiples of 8", "nearest 96x64 or 104x64"],
    ),
}


@pytest.mark.usefixtures("keep_logging")
@pytest.mark.parametrize("case", list(BAD_SETUPS))
def test_bad_setup_gives_its_message_and_code(case, setups, scan, wider_scan, tmp_path):
    """In this process, through click's runner: the same parsing, checks, messages and exit codes as
    from a shell, without paying stk-train's imports (~5 s) once per case."""
    extra, code, messages = BAD_SETUPS[case]
    model, cache = setups(Family.SD)
    (tmp_path / "bad.json").write_text("{ not json")
    (tmp_path / "fp16.json").write_text(json.dumps({"fp16": {"enabled": True}}))
    (tmp_path / "empty.txt").write_text("\n  \n")
    substitutions = {
        "BAD_JSON": str(tmp_path / "bad.json"),
        "FP16": str(tmp_path / "fp16.json"),
        "EMPTY": str(tmp_path / "empty.txt"),
    }
    args = ["--cache", cache, "--scan", scan, "--model", model]
    for flag, value in (("--no-cache", cache), ("--no-scan", scan)):
        if flag in extra:
            at = args.index(value)
            args, extra = args[: at - 1] + args[at + 1 :], [e for e in extra if e != flag]
    if "--other-model" in extra:
        args[args.index(model)], extra = setups(Family.SDXL)[0], []
    if "--unknown-model" in extra:  # a pipeline of no family stk knows
        unknown = shutil.copytree(model, tmp_path / "unknown")
        (unknown / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
        args[args.index(model)], extra = str(unknown), []
    if "--wider-scan" in extra:
        args[args.index(scan)], extra = wider_scan, []
    extra = [substitutions.get(e, e) for e in extra]
    out = tmp_path / "run"
    argv = [*map(str, [*args, "--output-dir", out, "--max-steps", "1", *FAST, *extra])]
    result = CliRunner().invoke(train_main, argv, env=clean_env(DS_ACCELERATOR="cpu"), catch_exceptions=False)
    assert result.exit_code == code, result.stderr
    for message in messages:
        assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
