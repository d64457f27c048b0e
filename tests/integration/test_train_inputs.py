"""stk-train fed and launched otherwise: images encoded on the fly, an S3 cache through a local shard directory, and
srun with PMI-2 running the same command.

Real DeepSpeed engines on the CPU under `mpiexec -n 2`, tiny random-weight pipelines and caches made by stk-cache
(fixtures `scan` and `setups`)."""

from __future__ import annotations

import subprocess

import pytest
from support.cache_builds import error_lines
from support.commands import FAST, run_train, summary_of, train_command, train_env
from support.train_checks import check_final
from support.train_outputs import metrics

from stk.errors import ExitCode
from stk.models import Family

pytestmark = pytest.mark.integration


def test_vae_on_the_fly_trains_from_the_scan_and_images(setups, scan, tmp_path):
    model, _ = setups(Family.SDXL)
    out = tmp_path / "run"
    proc = run_train(
        [
            "--vae-on-the-fly",
            "--scan",
            scan,
            "--model",
            model,
            "--output-dir",
            out,
            "--max-steps",
            "2",
            "--caption-dropout",
            "0.5",
            *FAST,
        ],
        mpi=2,
    )
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in metrics(out)] == [1, 2] and summary_of(proc)["final"] == str(out / "final")
    check_final(out / "final", Family.SDXL)


@pytest.mark.parametrize("case", ["vae-on-the-fly", "prompt-not-cached"])
def test_a_family_whose_text_encoder_only_stk_cache_loads_needs_its_captions_and_prompts_cached(
    case, setups, scan, tmp_path
):
    """Qwen-Image's text encoder (Qwen2.5-VL, 8B) loads in stk-cache only: stk-train refuses what would load it,
    before the denoiser loads, naming stk-cache."""
    model, cache = setups(Family.QWENIMAGE)
    if case == "vae-on-the-fly":
        args = ["--vae-on-the-fly", "--scan", scan]
    else:
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("a prompt stk-cache did not encode\n")
        args = ["--cache", cache, "--scan", scan, "--validation-prompts", prompts, "--validation-every", "1"]
    proc = run_train([*args, "--model", model, "--output-dir", tmp_path / "run", "--max-steps", "1", *FAST], mpi=0)
    assert proc.returncode == ExitCode.INPUT, proc.stderr
    (line,) = error_lines(proc)
    assert "stk-train does not load Qwen-Image's text encoder" in line and "stk-cache" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_trains_from_an_s3_cache_through_a_local_shard_directory(setups, scan, tmp_path, s3_server):
    from support.weed_server import S3_ENV, s3_client, upload_cache

    model, cache = setups(Family.SD)
    url = upload_cache(s3_client(s3_server), cache)
    local, out = tmp_path / "shards", tmp_path / "run"
    proc = run_train(
        [
            "--cache",
            url,
            "--scan",
            scan,
            "--model",
            model,
            "--output-dir",
            out,
            "--max-steps",
            "2",
            "--local-cache-dir",
            local,
            "--s3-endpoint-url",
            s3_server,
            *FAST,
        ],
        env=S3_ENV,
    )
    assert proc.returncode == 0, proc.stderr
    shards = sorted(p.name.split("-", 1)[1] for p in local.iterdir() if p.suffix == ".h5")
    assert shards == sorted(p.name for p in (cache / "shards").iterdir())  # whole shards, fetched once per node
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_srun_with_pmi2_runs_the_same_command(slurm_cluster, setups, tmp_path):
    """The same command under `srun --mpi=pmi2` of a real one-node Slurm: two tasks find their ranks
    and the rendezvous from MPI and train together."""
    model, cache = setups(Family.SD)
    out = tmp_path / "run"
    env = {**train_env(), "SLURM_CONF": slurm_cluster.env["SLURM_CONF"]}
    args = ["--cache", cache, "--model", model, "--output-dir", out, "--max-steps", "2", "--lora-rank", "4", *FAST]
    command = ["timeout", "240", "srun", "--mpi=pmi2", "-n", "2", "-c", "1", *train_command(args)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=260, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["steps"] == 2 and summary["final"] == str(out / "final")
    assert [r["step"] for r in metrics(out)] == [1, 2]
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()  # a LoRA: the same under srun
